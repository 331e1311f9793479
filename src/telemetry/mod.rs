//! What pipelines measure, below the backends that measure it: an epoch's outcome and
//! per-stage times, and trace spans with the same stage and track names on every backend.

mod outcome;
mod trace;

pub use outcome::{stalled, EpochOutcome, Progress, StageTimes};
pub use trace::{Stage, Trace, Track};
