//! NVRTC, loaded by stokehold itself.
//!
//! cudarc looks for `libnvrtc.so` and `libnvrtc.so.{12,11,...}` only, so a machine with
//! just a CUDA 13 toolkit (`libnvrtc.so.13`) would look NVRTC-less. stokehold searches the
//! usual places itself (`$STOKEHOLD_NVRTC`, `$CUDA_HOME`/`$CUDA_PATH`, `/usr/local/cuda*`,
//! pip's `nvidia-cuda-nvrtc`, then the loader's own path for every major version) and
//! calls the handful of NVRTC functions it needs directly.

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use libloading::Library;

type Program = *mut std::ffi::c_void;
type Status = c_int;

/// A loaded NVRTC library.
pub struct Nvrtc {
    lib: Library,
    path: String,
    version: (i32, i32),
    /// `libnvrtc-builtins`, loaded from NVRTC's own directory before the first compile.
    builtins: Option<(Library, PathBuf)>,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("builtins", &self.builtins())
            .finish()
    }
}

/// Where stokehold looks for NVRTC, in order.
pub fn candidates() -> Vec<String> {
    let names: Vec<String> = ["", ".13", ".12", ".11"]
        .iter()
        .map(|v| format!("libnvrtc.so{v}"))
        .collect();
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(d) = std::env::var_os(var) {
            dirs.push(Path::new(&d).join("lib64"));
            dirs.push(Path::new(&d).join("lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut cudas: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .map(|p| p.join("lib64"))
            .collect();
        cudas.sort();
        cudas.reverse();
        dirs.extend(cudas);
    }
    for root in ["/usr/local/lib", "/usr/lib"] {
        if let Ok(entries) = std::fs::read_dir(root) {
            for e in entries.filter_map(|e| e.ok()) {
                let n = e.file_name();
                if n.to_string_lossy().starts_with("python3") {
                    for site in ["dist-packages", "site-packages"] {
                        dirs.push(e.path().join(site).join("nvidia/cuda_nvrtc/lib"));
                        dirs.push(e.path().join(site).join("nvidia/cu13/lib"));
                    }
                }
            }
        }
    }
    let mut out: Vec<String> = Vec::new();
    if let Some(p) = std::env::var_os("STOKEHOLD_NVRTC") {
        out.push(p.to_string_lossy().into_owned());
    }
    for d in dirs {
        for n in &names {
            let p = d.join(n);
            if p.exists() {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    // Finally the dynamic loader's own search path, by name.
    out.extend(names);
    out
}

/// Loads `libnvrtc-builtins.so.MAJOR.MINOR` from the directory of the NVRTC at `nvrtc`
/// (a path, not a bare name), globally, so that NVRTC's own `dlopen` of it by name finds
/// it already loaded.
///
/// NVRTC 13.0 looks for its builtins on the loader's search path only: a toolkit or a pip
/// wheel (`nvidia-cuda-nvrtc`) outside that path would fail every compile with
/// `NVRTC_ERROR_BUILTIN_OPERATION_FAILURE`. A bare library name was found on that path,
/// where NVRTC finds its builtins by itself: nothing to do.
fn load_builtins(nvrtc: &Path, (major, minor): (i32, i32)) -> Option<(Library, PathBuf)> {
    let dir = nvrtc.parent().filter(|d| !d.as_os_str().is_empty())?;
    // The real directory, where the library is reached through a link.
    let dirs = [
        Some(dir.to_path_buf()),
        std::fs::canonicalize(nvrtc)
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf)),
    ];
    let names = [
        format!("libnvrtc-builtins.so.{major}.{minor}"),
        format!("libnvrtc-builtins.so.{major}"),
        "libnvrtc-builtins.so".to_string(),
    ];
    for d in dirs.iter().flatten() {
        for n in &names {
            let p = d.join(n);
            if !p.exists() {
                continue;
            }
            // SAFETY: loading the builtins runs their initialisers, which have no
            // preconditions; RTLD_GLOBAL makes the library visible to NVRTC's lookup by
            // name.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(&p),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            };
            if let Ok(lib) = lib {
                return Some((lib.into(), p));
            }
        }
    }
    None
}

impl Nvrtc {
    /// Loads the first NVRTC found among [`candidates`], and its builtins library from
    /// the same directory.
    ///
    /// # Errors
    /// A one-line reason naming where it looked.
    pub fn load() -> Result<Nvrtc, String> {
        let tried = candidates();
        for c in &tried {
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
            let Ok(lib) = (unsafe { Library::new(c) }) else {
                continue;
            };
            let mut nv = Nvrtc {
                lib,
                path: c.clone(),
                version: (0, 0),
                builtins: None,
            };
            let (mut major, mut minor) = (0, 0);
            // SAFETY: `nvrtcVersion(int*, int*)` writes two ints.
            let ok = unsafe {
                nv.sym::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status>(b"nvrtcVersion\0")
                    .map(|f| f(&mut major, &mut minor) == 0)
            };
            if ok == Ok(true) {
                nv.version = (major, minor);
                nv.builtins = load_builtins(Path::new(c), nv.version);
                return Ok(nv);
            }
        }
        let shown: Vec<&str> = tried.iter().map(String::as_str).take(8).collect();
        Err(format!(
            "NVRTC not found: looked for {}{} (set STOKEHOLD_NVRTC to its path)",
            shown.join(", "),
            if tried.len() > 8 { ", ..." } else { "" }
        ))
    }

    /// The library's path or name as loaded.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC's version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The `libnvrtc-builtins` loaded from NVRTC's own directory, if one was found there.
    pub fn builtins(&self) -> Option<&Path> {
        self.builtins.as_ref().map(|(_, p)| p.as_path())
    }

    /// The real architectures this NVRTC can build a cubin for, as compute capabilities
    /// (`(9, 0)` for `sm_90`), oldest first. Empty when the library cannot say (NVRTC
    /// before 11.2).
    pub fn supported_archs(&self) -> Vec<(i32, i32)> {
        type Num = unsafe extern "C" fn(*mut c_int) -> Status;
        type Archs = unsafe extern "C" fn(*mut c_int) -> Status;
        // SAFETY: `nvrtcGetNumSupportedArchs(int*)` writes one int; then
        // `nvrtcGetSupportedArchs(int*)` writes that many into a buffer of that length.
        unsafe {
            let (Ok(num), Ok(get)) = (
                self.sym::<Num>(b"nvrtcGetNumSupportedArchs\0"),
                self.sym::<Archs>(b"nvrtcGetSupportedArchs\0"),
            ) else {
                return Vec::new();
            };
            let mut n: c_int = 0;
            if num(&mut n) != 0 || n <= 0 {
                return Vec::new();
            }
            let mut archs = vec![0 as c_int; n as usize];
            if get(archs.as_mut_ptr()) != 0 {
                return Vec::new();
            }
            archs.iter().map(|&a| (a / 10, a % 10)).collect()
        }
    }

    /// # Safety
    /// `T` must be the C signature of the symbol `name` (NUL-terminated).
    unsafe fn sym<T>(&self, name: &[u8]) -> Result<libloading::Symbol<'_, T>, String> {
        // SAFETY: forwarded to the caller.
        unsafe { self.lib.get::<T>(name) }.map_err(|e| {
            format!(
                "{} lacks {}: {e}",
                self.path,
                String::from_utf8_lossy(&name[..name.len() - 1])
            )
        })
    }

    /// Compiles CUDA C `source` to PTX with `options` (e.g.
    /// `--gpu-architecture=compute_90`).
    ///
    /// # Errors
    /// The compiler's log when compilation fails, or the NVRTC error.
    pub fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<String, String> {
        let bytes = self.compile_to(source, name, options, false)?;
        String::from_utf8(bytes).map_err(|_| "PTX is not UTF-8".to_string())
    }

    /// Compiles CUDA C `source` to a cubin for one real architecture (`options` must
    /// name it, e.g. `--gpu-architecture=sm_90`). A cubin needs no JIT at load, so it
    /// also loads where the driver is older than this NVRTC's PTX.
    ///
    /// # Errors
    /// As [`compile`](Nvrtc::compile).
    pub fn compile_cubin(
        &self,
        source: &str,
        name: &str,
        options: &[String],
    ) -> Result<Vec<u8>, String> {
        self.compile_to(source, name, options, true)
    }

    fn compile_to(
        &self,
        source: &str,
        name: &str,
        options: &[String],
        cubin: bool,
    ) -> Result<Vec<u8>, String> {
        let src = CString::new(source).map_err(|_| "kernel source holds a NUL byte".to_string())?;
        let cname = CString::new(name).map_err(|_| "kernel name holds a NUL byte".to_string())?;
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| format!("option {o:?} holds a NUL")))
            .collect::<Result<_, _>>()?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: every call below follows NVRTC's documented C signatures; pointers are
        // to live CStrings or to locals of the right type; the program is destroyed on
        // every path after creation.
        unsafe {
            type Create = unsafe extern "C" fn(
                *mut Program,
                *const c_char,
                *const c_char,
                c_int,
                *const *const c_char,
                *const *const c_char,
            ) -> Status;
            type Compile = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
            type Size = unsafe extern "C" fn(Program, *mut usize) -> Status;
            type Get = unsafe extern "C" fn(Program, *mut c_char) -> Status;
            type Destroy = unsafe extern "C" fn(*mut Program) -> Status;
            type ErrStr = unsafe extern "C" fn(Status) -> *const c_char;
            let create = self.sym::<Create>(b"nvrtcCreateProgram\0")?;
            let compile = self.sym::<Compile>(b"nvrtcCompileProgram\0")?;
            let (size_sym, get_sym): (&[u8], &[u8]) = if cubin {
                (b"nvrtcGetCUBINSize\0", b"nvrtcGetCUBIN\0")
            } else {
                (b"nvrtcGetPTXSize\0", b"nvrtcGetPTX\0")
            };
            let ptx_size = self.sym::<Size>(size_sym)?;
            let get_ptx = self.sym::<Get>(get_sym)?;
            let log_size = self.sym::<Size>(b"nvrtcGetProgramLogSize\0")?;
            let get_log = self.sym::<Get>(b"nvrtcGetProgramLog\0")?;
            let destroy = self.sym::<Destroy>(b"nvrtcDestroyProgram\0")?;
            let err_str = self.sym::<ErrStr>(b"nvrtcGetErrorString\0")?;
            let describe = |s: Status| {
                let p = err_str(s);
                if p.is_null() {
                    format!("NVRTC error {s}")
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            let mut prog: Program = std::ptr::null_mut();
            let s = create(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if s != 0 {
                return Err(format!("nvrtcCreateProgram: {}", describe(s)));
            }
            let status = compile(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let result = if status != 0 {
                let mut n = 0usize;
                let mut log = String::new();
                if log_size(prog, &mut n) == 0 && n > 0 {
                    let mut buf = vec![0u8; n];
                    if get_log(prog, buf.as_mut_ptr().cast()) == 0 {
                        log = String::from_utf8_lossy(&buf[..n - 1]).into_owned();
                    }
                }
                Err(format!("{name}: {}\n{log}", describe(status)))
            } else {
                let mut n = 0usize;
                let what = if cubin { "cubin" } else { "PTX" };
                let s = ptx_size(prog, &mut n);
                if s != 0 || n == 0 {
                    Err(format!("getting the {what} size: {}", describe(s)))
                } else {
                    let mut buf = vec![0u8; n];
                    let s = get_ptx(prog, buf.as_mut_ptr().cast());
                    if s != 0 {
                        Err(format!("getting the {what}: {}", describe(s)))
                    } else {
                        if !cubin {
                            // PTX is a C string: drop its NUL.
                            buf.truncate(n - 1);
                        }
                        Ok(buf)
                    }
                }
            };
            destroy(&mut prog);
            result
        }
    }
}
