//! `stokehold inspect`: each `.npy` file's (or Megatron indexed dataset's, or Arrow
//! table's `input_ids`) shape, dtype, rows, bytes and page-cache residency, as a table.

use std::path::{Path, PathBuf};

use crate::dataset::{shape_string, Dataset, Documents, MappedFile, NpyArray};
use crate::error::Error;
use crate::pagecache;

/// The table of the `.npy` files, Megatron indexed datasets (named by their `.idx`) and
/// Arrow tables (`.arrow`, their `input_ids` column) at `paths` (files, or directories
/// whose `.npy`, `.idx` and `.arrow` files are listed in name order), and an error for
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
        if ext == "idx" || ext == "arrow" {
            let opened = match ext {
                "idx" => Documents::open_megatron(&f, 1, 0),
                _ => Documents::open_arrow(&f, "input_ids", 1, 0),
            };
            match opened {
                Ok(d) => {
                    let res = pagecache::residency(&d)
                        .map(|r| format!("{:.0}%", 100.0 * r.fraction()))
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
                    .map(|r| format!("{:.0}%", 100.0 * r.fraction()))
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

/// `path` itself, or the `.npy` and `.idx` files of the directory `path` in name order
/// (an error when there is none).
fn files(path: &Path, errors: &mut Vec<Error>) -> Vec<PathBuf> {
    match std::fs::read_dir(path) {
        Ok(entries) => {
            let mut v: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension()
                        .is_some_and(|e| e == "npy" || e == "idx" || e == "arrow")
                })
                .collect();
            v.sort();
            if v.is_empty() {
                errors.push(Error::dataset(
                    path,
                    "no .npy, .idx or .arrow file in this directory",
                ));
            }
            v
        }
        Err(_) => vec![path.to_path_buf()],
    }
}
