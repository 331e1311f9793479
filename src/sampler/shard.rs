//! Splitting an epoch across data-parallel ranks.

use crate::error::{Error, Result};

/// What to do with the samples that do not divide evenly among ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum ShardTail {
    /// Every rank gets `ceil(len / world)` samples; the missing ones repeat the start of
    /// the epoch's order (PyTorch's `DistributedSampler(drop_last=False)`).
    #[default]
    Pad,
    /// Every rank gets `floor(len / world)` samples; the tail of the order is dropped.
    Drop,
}

/// This process's part of each epoch: rank `rank` of `world_size`.
///
/// Ranks take interleaved positions of the shared epoch order (position `i * world + rank`),
/// so shards are disjoint, equal in size, and together cover the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "RawShard")]
pub struct Shard {
    rank: u64,
    world_size: u64,
    tail: ShardTail,
}

/// A shard as stored, validated into a [`Shard`] on deserialisation.
#[derive(serde::Deserialize)]
struct RawShard {
    rank: u64,
    world_size: u64,
    #[serde(default)]
    tail: ShardTail,
}

impl TryFrom<RawShard> for Shard {
    type Error = Error;
    fn try_from(r: RawShard) -> Result<Shard> {
        Ok(Shard::new(r.rank, r.world_size)?.with_tail(r.tail))
    }
}

impl Default for Shard {
    fn default() -> Self {
        Shard::single()
    }
}

/// Environment variables read by [`Shard::from_env`], in order of precedence.
const LAUNCHERS: [(&str, &str, &str); 3] = [
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
];

impl Shard {
    /// The whole epoch: rank 0 of 1.
    pub const fn single() -> Shard {
        Shard {
            rank: 0,
            world_size: 1,
            tail: ShardTail::Pad,
        }
    }

    /// Rank `rank` of `world_size`, padding the tail.
    ///
    /// # Errors
    /// [`Error::Config`] if `world_size == 0` or `rank >= world_size`.
    pub fn new(rank: u64, world_size: u64) -> Result<Shard> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!(
                "rank {rank} of world size {world_size}: need 0 <= rank < world_size"
            )));
        }
        Ok(Shard {
            rank,
            world_size,
            tail: ShardTail::Pad,
        })
    }

    /// The same shard with another tail rule.
    pub const fn with_tail(self, tail: ShardTail) -> Shard {
        Shard { tail, ..self }
    }

    /// Reads rank and world size from the launcher's environment: torchrun (`RANK`,
    /// `WORLD_SIZE`), then Slurm (`SLURM_PROCID`, `SLURM_NTASKS`), then Open MPI
    /// (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`). With none of them set, the
    /// process is alone: rank 0 of 1.
    ///
    /// # Errors
    /// [`Error::Shard`] when a launcher's pair is half set, not a number, or
    /// inconsistent (`rank >= world size`, world size 0), and when Slurm's pair says
    /// several tasks but no `SLURM_STEP_ID` is set: the process is then an `sbatch`
    /// script, not a task of an `srun` step, and would silently train one rank's share.
    pub fn from_env() -> Result<Shard> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Shard::from_env) over any source of variables (for tests).
    ///
    /// # Errors
    /// As [`from_env`](Shard::from_env).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Shard> {
        for (launcher, rank_var, world_var) in LAUNCHERS {
            let (rank, world) = match (get(rank_var), get(world_var)) {
                (None, None) => continue,
                (Some(r), Some(w)) => (r, w),
                (Some(_), None) => {
                    return Err(Error::Shard(format!(
                        "{rank_var} is set but {world_var} is not ({launcher})"
                    )))
                }
                (None, Some(_)) => {
                    return Err(Error::Shard(format!(
                        "{world_var} is set but {rank_var} is not ({launcher})"
                    )))
                }
            };
            let parse = |var: &str, value: &str| {
                value.trim().parse::<u64>().map_err(|_| {
                    Error::Shard(format!("{var}={value:?} is not a non-negative integer"))
                })
            };
            let (rank, world) = (parse(rank_var, &rank)?, parse(world_var, &world)?);
            // `sbatch` exports SLURM_NTASKS (the allocation's task count) and
            // SLURM_PROCID=0 to the batch script itself, which is one process, not rank 0
            // of a step: only tasks that `srun` starts have a step id.
            if launcher == "Slurm"
                && world > 1
                && get("SLURM_STEP_ID").is_none()
                && get("SLURM_STEPID").is_none()
            {
                return Err(Error::Shard(format!(
                    "{world_var}={world} but SLURM_STEP_ID is not set: this process is the \
                     sbatch script itself, not one of {world} tasks started by srun, and \
                     would train rank {rank} of {world} alone; start it with `srun`, or \
                     unset {world_var} to train on the whole epoch"
                )));
            }
            return Shard::new(rank, world).map_err(|_| {
                Error::Shard(format!(
                    "{rank_var}={rank} with {world_var}={world}: need {rank_var} < {world_var} ({launcher})"
                ))
            });
        }
        Ok(Shard::single())
    }

    /// This process's rank.
    pub const fn rank(&self) -> u64 {
        self.rank
    }

    /// The number of ranks.
    pub const fn world_size(&self) -> u64 {
        self.world_size
    }

    /// The tail rule.
    pub const fn tail(&self) -> ShardTail {
        self.tail
    }

    /// Samples this rank sees per epoch of `len` samples.
    pub const fn samples(&self, len: u64) -> u64 {
        match self.tail {
            ShardTail::Pad => len.div_ceil(self.world_size),
            ShardTail::Drop => len / self.world_size,
        }
    }

    /// The position in the epoch's global order of this rank's `i`-th sample
    /// (wrapped into `0..len` for padding).
    #[inline]
    pub const fn global_position(&self, i: u64, len: u64) -> u64 {
        (i * self.world_size + self.rank) % len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn reads_each_launcher() {
        let s = Shard::from_vars(vars(&[("RANK", "3"), ("WORLD_SIZE", "8")])).unwrap();
        assert_eq!((s.rank(), s.world_size()), (3, 8));
        let s = Shard::from_vars(vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ]))
        .unwrap();
        assert_eq!((s.rank(), s.world_size()), (1, 2));
        let s = Shard::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ]))
        .unwrap();
        assert_eq!((s.rank(), s.world_size()), (0, 4));
        assert_eq!(Shard::from_vars(vars(&[])).unwrap(), Shard::single());
        // torchrun wins over Slurm when both are set (torchrun inside srun).
        let s = Shard::from_vars(vars(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "16"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
        ]))
        .unwrap();
        assert_eq!((s.rank(), s.world_size()), (5, 16));
    }

    #[test]
    fn rejects_missing_and_inconsistent_values() {
        for bad in [
            vec![("RANK", "1")],
            vec![("WORLD_SIZE", "2")],
            vec![("RANK", "2"), ("WORLD_SIZE", "2")],
            vec![("RANK", "0"), ("WORLD_SIZE", "0")],
            vec![("RANK", "-1"), ("WORLD_SIZE", "2")],
            vec![("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")],
        ] {
            let err = Shard::from_vars(vars(&bad)).unwrap_err();
            assert!(matches!(err, Error::Shard(_)), "{bad:?}: {err}");
            assert!(err.to_string().contains(bad[0].0), "{err}");
        }
    }

    #[test]
    fn an_sbatch_script_is_not_rank_0() {
        // What `sbatch --ntasks=8` exports to the batch script: no step id.
        let e = Shard::from_vars(vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("SLURM_STEP_ID") && e.contains("srun"), "{e}");
        // One task needs no step: the whole epoch either way.
        let s = Shard::from_vars(vars(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).unwrap();
        assert_eq!(s, Shard::single());
        // Inside `srun`, tasks have a step id.
        let s = Shard::from_vars(vars(&[
            ("SLURM_PROCID", "7"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_ID", "3"),
        ]))
        .unwrap();
        assert_eq!((s.rank(), s.world_size()), (7, 8));
    }

    #[test]
    fn sizes_follow_the_tail_rule() {
        let pad = Shard::new(0, 3).unwrap();
        assert_eq!(pad.samples(10), 4);
        assert_eq!(pad.with_tail(ShardTail::Drop).samples(10), 3);
        assert_eq!(pad.global_position(3, 10), 9);
        assert_eq!(Shard::new(2, 3).unwrap().global_position(3, 10), 1);
    }
}
