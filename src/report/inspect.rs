//! `stokehold inspect`: each `.npy` file's (or Megatron indexed dataset's, Arrow
//! table's `input_ids`, or MDS shard's `tokens`) shape, dtype, rows, bytes and
//! page-cache residency, as a table.

use std::path::{Path, PathBuf};

use crate::dataset::{shape_string, Dataset, Documents, MappedFile, NpyArray};
use crate::error::Error;
use crate::pagecache;

/// The table of the `.npy` files, Megatron indexed datasets (named by their `.idx`),
/// Arrow tables (`.arrow`, their `input_ids` column) and MDS shards (`.mds`, their
/// `tokens` column) at `paths` (files, or directories whose files of those kinds are
/// listed in name order), and an error for
/// each path that could not be read. A dataset of documents shows its shape as
/// `(documents, <=longest)`, its bytes as its files'. A file's
/// residency shows as `?` where `mincore` fails.
pub fn inspect(paths: &[PathBuf]) -> (String, Vec<Error>) {
    let mut table = format!(
        "{:<40} {:>18} {:>8} {:>10} {:>12} {:>9}\n",
        "file", "shape", "dtype", "rows", "bytes", "resident"
    );
    let mut errors = Vec::new();
    let listed: Vec<PathBuf> = paths.iter().flat_map(|p| files(p, &mut errors)).collect();
    for f in listed {
        let ext = f.extension().and_then(|e| e.to_str()).unwrap_or_default();
        if DOCUMENTS.contains(&ext) {
            let opened = match ext {
                "idx" => Documents::open_megatron(&f, 1, 0),
                "mds" => Documents::open_mds(&f, "tokens", 1, 0),
                _ => Documents::open_arrow(&f, "input_ids", 1, 0),
            };
            match opened {
                Ok(d) => {
                    let res = pagecache::residency(&d)
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "?".into());
                    let bytes: usize = d.files().iter().map(|m| m.bytes().len()).sum();
                    table += &format!(
                        "{:<40} {:>18} {:>8} {:>10} {:>12} {:>9}\n",
                        f.display(),
                        format!("({}, <={})", d.len(), d.longest()),
                        d.dtype().name(),
                        d.len(),
                        bytes,
                        res
                    );
                }
                Err(e) => errors.push(e),
            }
            continue;
        }
        match NpyArray::open(&f) {
            Ok(a) => {
                let res = pagecache::file_residency(MappedFile::new(a.path(), a.mapping()))
                    .map(|r| r.to_string())
                    .unwrap_or_else(|_| "?".into());
                table += &format!(
                    "{:<40} {:>18} {:>8} {:>10} {:>12} {:>9}\n",
                    f.display(),
                    shape_string(a.shape()),
                    a.dtype().name(),
                    a.rows(),
                    a.mapping().len(),
                    res
                );
            }
            Err(e) => errors.push(e),
        }
    }
    (table, errors)
}

/// The extensions of the files that hold documents.
const DOCUMENTS: [&str; 3] = ["idx", "arrow", "mds"];

/// `path` itself, or the `.npy`, `.idx`, `.arrow` and `.mds` files of the directory
/// `path` in name order (an error when there is none).
fn files(path: &Path, errors: &mut Vec<Error>) -> Vec<PathBuf> {
    match std::fs::read_dir(path) {
        Ok(entries) => {
            let mut v: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension()
                        .and_then(|e| e.to_str())
                        .is_some_and(|e| e == "npy" || DOCUMENTS.contains(&e))
                })
                .collect();
            v.sort();
            if v.is_empty() {
                errors.push(Error::dataset(
                    path,
                    "no .npy, .idx, .arrow or .mds file in this directory",
                ));
            }
            v
        }
        Err(_) => vec![path.to_path_buf()],
    }
}
