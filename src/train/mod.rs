//! The training step's host side: the model, its parameters, loss and accuracy.

mod mlp;

pub use mlp::{loss, step, Metrics, Mlp, MlpConfig, Normalize, Workspace};
