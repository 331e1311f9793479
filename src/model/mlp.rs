//! The reference training step: a one-hidden-layer MLP classifier on the host.
//!
//! `u8` inputs are normalised as `(x - mean) * inv_std`, then
//! `h = relu(x W1 + b1)`, `z = h W2 + b2`, softmax cross-entropy against `i64` labels,
//! backward pass, and plain SGD. Matrices are row-major `f32`; the products use
//! `matrixmultiply`'s SIMD sgemm, with the SGD update folded into the weight-gradient
//! products (`W -= lr * A^T B` as one sgemm with `beta = 1`).

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::error::{Error, Result};
use crate::util::zeroed;

/// Shapes and hyper-parameters of the classifier.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MlpConfig {
    /// Input features per sample.
    pub inputs: usize,
    /// Hidden units: sets the compute per batch.
    pub hidden: usize,
    /// Classes.
    pub classes: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Seed of the initial weights.
    pub seed: u64,
}

/// Input normalisation: `(x - mean) * inv_std`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Normalize {
    /// Subtracted from each input byte.
    pub mean: f32,
    /// Multiplies the centred value.
    pub inv_std: f32,
}

impl Normalize {
    /// Mean and spread of some input bytes (e.g. the first rows of a dataset).
    pub fn fit(bytes: &[u8]) -> Normalize {
        if bytes.is_empty() {
            return Normalize {
                mean: 0.0,
                inv_std: 1.0,
            };
        }
        let n = bytes.len() as f64;
        let mean = bytes.iter().map(|&b| b as f64).sum::<f64>() / n;
        let var = bytes
            .iter()
            .map(|&b| (b as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        Normalize {
            mean: mean as f32,
            inv_std: if var > 0.0 {
                (1.0 / var.sqrt()) as f32
            } else {
                1.0
            },
        }
    }
}

/// The classifier's parameters, row-major: `w1` is `inputs x hidden`, `w2` is
/// `hidden x classes`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    /// Shapes and hyper-parameters.
    pub config: MlpConfig,
    /// First layer weights.
    pub w1: Vec<f32>,
    /// First layer bias.
    pub b1: Vec<f32>,
    /// Second layer weights.
    pub w2: Vec<f32>,
    /// Second layer bias.
    pub b2: Vec<f32>,
}

/// Loss and accuracy accumulated over steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Metrics {
    /// Sum of per-sample cross-entropy losses.
    pub loss_sum: f64,
    /// Samples whose arg-max prediction was the label (before the step's update).
    pub correct: u64,
    /// Samples seen.
    pub samples: u64,
}

impl Metrics {
    /// Mean loss.
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.samples.max(1) as f64
    }

    /// Share of correct predictions.
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.samples.max(1) as f64
    }
}

/// The most weights a model may have: 8 GiB of `f32`.
const MAX_PARAMS: usize = 1 << 31;

impl Mlp {
    /// He-initialised weights and zero biases, deterministic in `config.seed`.
    ///
    /// # Errors
    /// [`Error::Config`] if a dimension is zero, the weights would exceed 2^31 (8 GiB),
    /// or `lr` is not finite and positive.
    pub fn new(config: MlpConfig) -> Result<Mlp> {
        if config.inputs == 0 || config.hidden == 0 || config.classes < 2 {
            return Err(Error::Config(format!(
                "an MLP needs inputs >= 1, hidden >= 1 and classes >= 2, got {}/{}/{}",
                config.inputs, config.hidden, config.classes
            )));
        }
        if !(config.lr.is_finite() && config.lr > 0.0) {
            return Err(Error::Config(format!(
                "learning rate {} is not positive",
                config.lr
            )));
        }
        let MlpConfig {
            inputs: d,
            hidden: h,
            classes: c,
            ..
        } = config;
        let params = d
            .checked_mul(h)
            .zip(h.checked_mul(c))
            .and_then(|(a, b)| a.checked_add(b))
            .filter(|&p| p <= MAX_PARAMS);
        if params.is_none() {
            return Err(Error::Config(format!(
                "an MLP of {d} inputs, {h} hidden units and {c} classes has more than \
                 {MAX_PARAMS} weights (8 GiB): lower --hidden"
            )));
        }
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(config.seed);
        let mut init = |n: usize, fan_in: usize| -> Result<Vec<f32>> {
            let a = (6.0 / fan_in as f32).sqrt();
            let mut w = zeroed(n, "MLP weights")?;
            w.iter_mut().for_each(|w| *w = rng.random_range(-a..a));
            Ok(w)
        };
        Ok(Mlp {
            w1: init(d * h, d)?,
            b1: zeroed(h, "MLP weights")?,
            w2: init(h * c, h)?,
            b2: zeroed(c, "MLP weights")?,
            config,
        })
    }
}

/// Scratch buffers for one batch size, reused across steps.
#[derive(Debug, Clone)]
pub struct Workspace {
    batch: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    z: Vec<f32>,
    dh: Vec<f32>,
}

impl Workspace {
    /// Buffers for batches of up to `batch` samples.
    ///
    /// # Errors
    /// [`Error::Alloc`] if the buffers cannot be had (a huge batch times a wide layer).
    pub fn new(config: &MlpConfig, batch: usize) -> Result<Workspace> {
        let buffer = |width: usize| zeroed(batch.saturating_mul(width), "MLP workspace");
        Ok(Workspace {
            batch,
            x: buffer(config.inputs)?,
            h: buffer(config.hidden)?,
            z: buffer(config.classes)?,
            dh: buffer(config.hidden)?,
        })
    }
}

/// One layer's SGD update over the `n` rows of a batch, the update folded into the
/// weight-gradient product: `w -= lr * input^T grad` and `b -= lr * sum(grad)`, where
/// `input` is `n x inputs`, `grad` is `n x outputs` and `w` is `inputs x outputs`.
#[allow(clippy::too_many_arguments)]
fn sgd(
    n: usize,
    inputs: usize,
    outputs: usize,
    lr: f32,
    input: &[f32],
    grad: &[f32],
    w: &mut [f32],
    b: &mut [f32],
) {
    gemm(
        inputs,
        n,
        outputs,
        -lr,
        input,
        (1, inputs),
        grad,
        (outputs, 1),
        1.0,
        w,
        outputs,
    );
    for row in grad[..n * outputs].chunks_exact(outputs) {
        for (b, &g) in b.iter_mut().zip(row) {
            *b -= lr * g;
        }
    }
}

/// `c = alpha * a(m x k) b(k x n) + beta * c`, with explicit strides (row, column).
#[allow(clippy::too_many_arguments)]
fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    // The furthest element each operand is read or written at must be in bounds (and
    // its offset must not wrap: release builds do not check overflow).
    let within = |len: usize, rows: usize, cols: usize, rs: usize, cs: usize| {
        (rows - 1)
            .checked_mul(rs)
            .zip((cols.max(1) - 1).checked_mul(cs))
            .and_then(|(r, c)| r.checked_add(c))
            .is_some_and(|last| last < len)
    };
    assert!(
        k == 0 || within(a.len(), m, k, rsa, csa),
        "gemm: a is too short"
    );
    assert!(
        k == 0 || within(b.len(), k, n, rsb, csb),
        "gemm: b is too short"
    );
    assert!(within(c.len(), m, n, rsc, 1), "gemm: c is too short");
    // SAFETY: the asserts above show every index the product touches lies inside the
    // slices; `c` is borrowed mutably and distinct from `a` and `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// Forward pass of `n` samples: fills `ws.x`, `ws.h` (post-ReLU) and `ws.z` (logits).
fn forward(mlp: &Mlp, ws: &mut Workspace, norm: Normalize, x: &[u8], n: usize) {
    let MlpConfig {
        inputs: d,
        hidden: h,
        classes: c,
        ..
    } = mlp.config;
    for (o, &b) in ws.x[..n * d].iter_mut().zip(&x[..n * d]) {
        *o = (b as f32 - norm.mean) * norm.inv_std;
    }
    dense(n, (d, h), &ws.x, (&mlp.w1, &mlp.b1), &mut ws.h);
    for v in &mut ws.h[..n * h] {
        *v = v.max(0.0);
    }
    dense(n, (h, c), &ws.h, (&mlp.w2, &mlp.b2), &mut ws.z);
}

/// A dense layer on `n` rows: `out(n x m) = input(n x k) weights(k x m) + bias`, with
/// the bias broadcast over the rows first.
fn dense(
    n: usize,
    (k, m): (usize, usize),
    input: &[f32],
    (weights, bias): (&[f32], &[f32]),
    out: &mut [f32],
) {
    for row in out[..n * m].chunks_exact_mut(m) {
        row.copy_from_slice(bias);
    }
    gemm(n, k, m, 1.0, input, (k, 1), weights, (m, 1), 1.0, out, m);
}

fn check_labels(y: &[i64], classes: usize, indices: &[u64]) -> Result<()> {
    match y.iter().position(|&l| l < 0 || l as u64 >= classes as u64) {
        None => Ok(()),
        Some(k) => Err(Error::Label {
            label: y[k],
            classes,
            sample: indices.get(k).copied(),
        }),
    }
}

/// Mean loss of the first `n` samples (`y.len()`, at most the workspace's batch)
/// without updating anything (for tests and evaluation).
///
/// # Errors
/// [`Error::Label`] for a label outside `0..classes`; [`Error::Config`] if `x` holds
/// fewer than `n` rows.
pub fn loss(mlp: &Mlp, ws: &mut Workspace, norm: Normalize, x: &[u8], y: &[i64]) -> Result<f64> {
    let n = y.len().min(ws.batch);
    let d = mlp.config.inputs;
    if n.checked_mul(d).map_or(true, |bytes| x.len() < bytes) {
        return Err(Error::Config(format!(
            "{n} samples of {d} input bytes, and {} bytes given",
            x.len()
        )));
    }
    check_labels(&y[..n], mlp.config.classes, &[])?;
    forward(mlp, ws, norm, x, n);
    let c = mlp.config.classes;
    let mut sum = 0.0f64;
    for (row, &label) in ws.z[..n * c].chunks_exact(c).zip(y) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = max as f64
            + row
                .iter()
                .map(|&v| ((v - max) as f64).exp())
                .sum::<f64>()
                .ln();
        sum += lse - row[label as usize] as f64;
    }
    Ok(sum / n.max(1) as f64)
}

/// One SGD step on a batch: `x` holds `y.len()` rows of `inputs` bytes. Adds the batch's
/// loss and correct predictions (measured before the update) to `metrics`.
///
/// `indices` (the batch's dataset indices, may be empty) only serves error messages.
///
/// # Errors
/// [`Error::Label`] for a label outside `0..classes`; [`Error::Config`] if the batch is
/// larger than the workspace or `x` is too short.
pub fn step(
    mlp: &mut Mlp,
    ws: &mut Workspace,
    norm: Normalize,
    x: &[u8],
    y: &[i64],
    indices: &[u64],
    metrics: &mut Metrics,
) -> Result<()> {
    let n = y.len();
    let MlpConfig {
        inputs: d,
        hidden: h,
        classes: c,
        lr,
        ..
    } = mlp.config;
    if n > ws.batch || n.checked_mul(d).map_or(true, |bytes| x.len() < bytes) {
        return Err(Error::Config(format!(
            "a batch of {n} samples with {} input bytes does not fit a workspace of {} x {d}",
            x.len(),
            ws.batch
        )));
    }
    if n == 0 {
        return Ok(());
    }
    check_labels(y, c, indices)?;
    forward(mlp, ws, norm, x, n);

    // Softmax cross-entropy; z becomes dL/dz = (softmax - onehot) / n.
    let inv_n = 1.0 / n as f32;
    for (row, &label) in ws.z[..n * c].chunks_exact_mut(c).zip(y) {
        let label = label as usize;
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let arg = row.iter().position(|&v| v == max).unwrap_or(0);
        // log softmax of the label, before exponentiation: finite however negative the
        // label's logit (ln of an underflowed exp would be infinite).
        let z_label = row[label] - max;
        let mut sum = 0.0f32;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        metrics.loss_sum += (sum.ln() - z_label) as f64;
        metrics.correct += u64::from(arg == label);
        for v in row.iter_mut() {
            *v *= inv_n / sum;
        }
        row[label] -= inv_n;
    }
    metrics.samples += n as u64;

    // dh = dz W2^T, masked by the ReLU (uses W2 before its update).
    gemm(
        n,
        c,
        h,
        1.0,
        &ws.z,
        (c, 1),
        &mlp.w2,
        (1, c),
        0.0,
        &mut ws.dh,
        h,
    );
    for (g, &a) in ws.dh[..n * h].iter_mut().zip(&ws.h[..n * h]) {
        if a <= 0.0 {
            *g = 0.0;
        }
    }
    // W2 -= lr h^T dz, b2 -= lr sum(dz); then W1 and b1 from dh (computed with the old W2).
    sgd(n, h, c, lr, &ws.h, &ws.z, &mut mlp.w2, &mut mlp.b2);
    sgd(n, d, h, lr, &ws.x, &ws.dh, &mut mlp.w1, &mut mlp.b1);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> (Mlp, Vec<u8>, Vec<i64>, Normalize) {
        let config = MlpConfig {
            inputs: 5,
            hidden: 4,
            classes: 3,
            lr: 1.0,
            seed: 3,
        };
        let mlp = Mlp::new(config).unwrap();
        let x: Vec<u8> = (0..6 * 5).map(|i| ((i * 37) % 251) as u8).collect();
        let y = vec![0, 1, 2, 1, 0, 2];
        let norm = Normalize::fit(&x);
        (mlp, x, y, norm)
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (mlp, x, y, norm) = tiny();
        let mut ws = Workspace::new(&mlp.config, 6).unwrap();
        // One step with lr = 1 moves each parameter by minus its gradient.
        let mut stepped = mlp.clone();
        step(
            &mut stepped,
            &mut ws,
            norm,
            &x,
            &y,
            &[],
            &mut Metrics::default(),
        )
        .unwrap();
        let eps = 1e-2f32;
        let check = |get: &dyn Fn(&Mlp) -> &Vec<f32>, set: &dyn Fn(&mut Mlp) -> &mut Vec<f32>| {
            for i in 0..get(&mlp).len() {
                let analytic = get(&mlp)[i] - get(&stepped)[i];
                let mut plus = mlp.clone();
                set(&mut plus)[i] += eps;
                let mut minus = mlp.clone();
                set(&mut minus)[i] -= eps;
                let mut ws = Workspace::new(&mlp.config, 6).unwrap();
                let numeric = (loss(&plus, &mut ws, norm, &x, &y).unwrap()
                    - loss(&minus, &mut ws, norm, &x, &y).unwrap())
                    / (2.0 * eps as f64);
                assert!(
                    (analytic as f64 - numeric).abs() < 2e-3 + 2e-2 * numeric.abs(),
                    "param {i}: analytic {analytic}, numeric {numeric}"
                );
            }
        };
        check(&|m| &m.w1, &|m| &mut m.w1);
        check(&|m| &m.b1, &|m| &mut m.b1);
        check(&|m| &m.w2, &|m| &mut m.w2);
        check(&|m| &m.b2, &|m| &mut m.b2);
    }

    #[test]
    fn bad_labels_are_errors() {
        let (mut mlp, x, _, norm) = tiny();
        let mut ws = Workspace::new(&mlp.config, 6).unwrap();
        let y = vec![0, 1, 3, 0, 0, 0];
        let err = step(
            &mut mlp,
            &mut ws,
            norm,
            &x,
            &y,
            &[10, 11, 12, 13, 14, 15],
            &mut Metrics::default(),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Label {
                    label: 3,
                    classes: 3,
                    sample: Some(12)
                }
            ),
            "{err}"
        );
        let y = vec![0, -1, 0, 0, 0, 0];
        assert!(step(
            &mut mlp,
            &mut ws,
            norm,
            &x,
            &y,
            &[],
            &mut Metrics::default()
        )
        .is_err());
    }

    #[test]
    fn a_config_changed_to_overflow_is_an_error_not_a_wild_read() {
        let (mut mlp, x, y, norm) = tiny();
        let mut ws = Workspace::new(&mlp.config, 6).unwrap();
        // `config` is a public field: rows * inputs wraps to a small number.
        mlp.config.inputs = (1 << 63) + 1;
        let mut m = Metrics::default();
        assert!(step(&mut mlp, &mut ws, norm, &x, &y[..2], &[], &mut m).is_err());
        assert!(loss(&mlp, &mut ws, norm, &x, &y[..2]).is_err());
    }

    #[test]
    fn the_loss_stays_finite_for_confident_mistakes() {
        let (mut mlp, x, y, norm) = tiny();
        // Logits thousands apart: exp of the label's logit underflows to 0.
        mlp.w2.iter_mut().for_each(|w| *w *= 1e4);
        mlp.config.lr = 1e-9;
        let mut ws = Workspace::new(&mlp.config, 6).unwrap();
        let mut m = Metrics::default();
        step(&mut mlp, &mut ws, norm, &x, &y, &[], &mut m).unwrap();
        assert!(
            m.loss_sum.is_finite() && m.loss_sum > 100.0,
            "{}",
            m.loss_sum
        );
    }

    #[test]
    fn a_workspace_too_large_to_allocate_is_an_error_not_an_abort() {
        let (mlp, ..) = tiny();
        // 2^60 samples of a few floats each: no allocator can say yes.
        let err = Workspace::new(&mlp.config, 1 << 60)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MLP workspace"), "{err}");
    }

    #[test]
    fn loss_goes_down_on_a_repeated_batch() {
        let (mut mlp, x, y, norm) = tiny();
        mlp.config.lr = 0.1;
        let mut ws = Workspace::new(&mlp.config, 6).unwrap();
        let before = loss(&mlp, &mut ws, norm, &x, &y).unwrap();
        for _ in 0..50 {
            step(
                &mut mlp,
                &mut ws,
                norm,
                &x,
                &y,
                &[],
                &mut Metrics::default(),
            )
            .unwrap();
        }
        let after = loss(&mlp, &mut ws, norm, &x, &y).unwrap();
        assert!(after < before * 0.5, "{before} -> {after}");
    }
}
