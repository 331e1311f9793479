//! The model's math on the host: the MLP classifier, its normalisation, its loss and SGD
//! step, and fitting it to a dataset. The reference the CUDA kernels are checked against.

mod fit;
mod mlp;

pub use fit::fit_classifier;
pub use mlp::{loss, step, Metrics, Mlp, MlpConfig, Normalize, Workspace};
