//! The training step's host side: the model, its parameters, loss and accuracy.

mod mlp;
mod run;

pub use mlp::{loss, step, Metrics, Mlp, MlpConfig, Normalize, Workspace};
pub use run::{fit_classifier, run, TrainConfig};
