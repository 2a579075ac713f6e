//! Finding libnvrtc and compiling the kernel sources to PTX.
//!
//! cudarc (feature `dynamic-loading`) dlopens NVRTC by bare names (`libnvrtc.so`,
//! `libnvrtc.so.12`, …), i.e. through the system search path. To use the NVRTC that PyPI's
//! `nvidia-cuda-nvrtc-cu12` wheel ships (no CUDA toolkit needed), [`ensure_loaded`] first loads
//! the library from an explicit path and keeps it loaded: glibc then answers cudarc's
//! `dlopen("libnvrtc.so.12")` with that already-loaded object, because the name matches its
//! SONAME. NVRTC finds its `libnvrtc-builtins` next to itself (the wheel's RUNPATH is `$ORIGIN`).
//!
//! Compiling needs only the library, never a GPU or a driver.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use super::sources::KernelSource;
use crate::compat::{CodeTarget, Version};

/// Path of libnvrtc (the `.so` itself or the directory holding it).
pub const NVRTC_LIB_ENV: &str = "INFER_NVRTC_LIB";

/// Where `kernels/fetch-nvrtc.sh` installs the wheel's library.
pub fn wheel_lib_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/nvrtc/nvidia/cuda_nvrtc/lib")
}

/// A GPU architecture, e.g. 9.0 (H100) or 12.0 (RTX 50xx).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    pub const H100: Self = Self { major: 9, minor: 0 };
    pub const RTX_50: Self = Self {
        major: 12,
        minor: 0,
    };

    /// The virtual architecture NVRTC compiles PTX for. PTX (not a cubin) is what we load: the
    /// driver JIT-compiles it for the exact GPU, so one target serves a whole family.
    pub fn virtual_arch(&self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }
}

/// Make libnvrtc loadable, trying in order: `$INFER_NVRTC_LIB`, the wheel installed by
/// `fetch-nvrtc.sh`, then the system search path (a CUDA toolkit, `LD_LIBRARY_PATH`).
/// Returns a description of where it was found, or why it was not. Idempotent.
pub fn ensure_loaded() -> Result<&'static str, &'static str> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND
        .get_or_init(locate_and_load)
        .as_ref()
        .map(String::as_str)
        .map_err(String::as_str)
}

fn locate_and_load() -> Result<String, String> {
    if let Some(path) = std::env::var_os(NVRTC_LIB_ENV) {
        let path = PathBuf::from(path);
        // An explicit setting that does not work is an error, not a reason to look elsewhere.
        return preload(&path).map(|lib| format!("{} (from ${NVRTC_LIB_ENV})", lib.display()));
    }
    let wheel = wheel_lib_dir();
    if wheel.is_dir() {
        return preload(&wheel).map(|lib| format!("{} (fetch-nvrtc.sh wheel)", lib.display()));
    }
    // SAFETY: loading NVRTC runs its initialisers only; it is the library cudarc would load.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok("system search path".into());
    }
    Err(format!(
        "libnvrtc not found: set {NVRTC_LIB_ENV}, run kernels/fetch-nvrtc.sh, or install CUDA"
    ))
}

/// Load libnvrtc from `path` (a file, or a directory holding `libnvrtc.so*`) and never unload it.
fn preload(path: &Path) -> Result<PathBuf, String> {
    let lib = if path.is_dir() {
        ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"]
            .iter()
            .map(|name| path.join(name))
            .find(|p| p.exists())
            .ok_or_else(|| format!("no libnvrtc.so* in {}", path.display()))?
    } else {
        path.to_path_buf()
    };
    // SAFETY: as above; the handle is leaked on purpose so the library stays mapped for cudarc.
    let handle = unsafe { libloading::Library::new(&lib) }
        .map_err(|e| format!("cannot load {}: {e}", lib.display()))?;
    std::mem::forget(handle);
    Ok(lib)
}

/// NVRTC's (major, minor) version. Call [`ensure_loaded`] first.
pub fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; nvrtcVersion cannot fail with valid pointers.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    assert_eq!(status, cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS);
    (major, minor)
}

/// The architectures this NVRTC compiles for, numbered as [`crate::compat::arch_code`]
/// numbers them. Call [`ensure_loaded`] first.
pub fn supported_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys::{nvrtcGetNumSupportedArchs, nvrtcGetSupportedArchs, nvrtcResult};
    let mut n = 0;
    // SAFETY: an out-parameter, then a buffer of the size NVRTC gave.
    unsafe {
        if nvrtcGetNumSupportedArchs(&mut n) != nvrtcResult::NVRTC_SUCCESS || n <= 0 {
            return Vec::new();
        }
        let mut archs = vec![0; n as usize];
        if nvrtcGetSupportedArchs(archs.as_mut_ptr()) != nvrtcResult::NVRTC_SUCCESS {
            return Vec::new();
        }
        archs
    }
}

/// The NVRTC options every source is compiled with, beyond the program name;
/// `gpu_arch` is `compute_90`, `sm_120`, ….
fn options(gpu_arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={gpu_arch}"),
        "-std=c++17".into(),
    ]
}

/// Compiles `source` for `target`: a cubin, or PTX text. An error carries NVRTC's log. Call
/// [`ensure_loaded`] first.
pub fn compile_to(source: &KernelSource, target: CodeTarget) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::{CStr, CString};

    let src = CString::new(source.program()).expect("no NUL in kernel sources");
    let name = CString::new(format!("{}.cu", source.name)).expect("no NUL in names");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| e.to_string())?;
    // SAFETY: `prog` is live until destroyed at the end; `src` and `name` outlive it; each
    // buffer has the size NVRTC reported.
    unsafe {
        let out = match result::compile_program(prog, &options(&target.nvrtc_arch())) {
            Err(e) => Err(match result::get_program_log(prog) {
                Ok(log) => format!("{e}: {}", CStr::from_ptr(log.as_ptr()).to_string_lossy()),
                Err(_) => e.to_string(),
            }),
            Ok(()) => match target {
                CodeTarget::Cubin(_) => {
                    let mut size = 0;
                    let mut cubin = Vec::new();
                    let mut status = sys::nvrtcGetCUBINSize(prog, &mut size);
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        cubin = vec![0u8; size];
                        status = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                    }
                    match status {
                        sys::nvrtcResult::NVRTC_SUCCESS => Ok(cubin),
                        e => Err(format!("reading the cubin: {e:?}")),
                    }
                }
                CodeTarget::Ptx(_) => result::get_ptx(prog)
                    .map(|ptx| CStr::from_ptr(ptx.as_ptr()).to_bytes().to_vec())
                    .map_err(|e| e.to_string()),
            },
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// [`compile_to`] through `cache`, a directory: each result is kept under a name hashing
/// everything it depends on (the program text, the target, NVRTC's version), so a start
/// after the first compiles nothing. A cache that cannot be read or written is passed by
/// (the code is compiled, as without one). Call [`ensure_loaded`] first.
pub fn compile_cached(
    source: &KernelSource,
    target: CodeTarget,
    cache: Option<&Path>,
) -> Result<Vec<u8>, String> {
    let Some(dir) = cache else {
        return compile_to(source, target);
    };
    let mut h = DefaultHasher::new();
    (
        source.program(),
        options(&target.nvrtc_arch()),
        nvrtc_version(),
    )
        .hash(&mut h);
    let ext = match target {
        CodeTarget::Cubin(_) => "cubin",
        CodeTarget::Ptx(_) => "ptx",
    };
    let path = dir.join(format!(
        "{}-{}-{:016x}.{ext}",
        source.name,
        target.nvrtc_arch(),
        h.finish()
    ));
    if let Ok(code) = std::fs::read(&path) {
        if !code.is_empty() {
            return Ok(code);
        }
    }
    let code = compile_to(source, target)?;
    // Written aside, then renamed: a reader never sees half a file.
    let tmp = path.with_extension(format!("{ext}.{}.tmp", std::process::id()));
    let _ = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, &code))
        .and_then(|()| std::fs::rename(&tmp, &path));
    let _ = std::fs::remove_file(&tmp);
    Ok(code)
}

/// The CUDA version the driver supports.
pub fn driver_version() -> Result<Version, cudarc::driver::DriverError> {
    let mut v = 0;
    // SAFETY: an out-parameter.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(Version::from_driver(v))
}

/// Compile one kernel source to PTX for `arch`. Call [`ensure_loaded`] first.
pub fn compile(source: &KernelSource, arch: ComputeCapability) -> Result<Ptx, CompileError> {
    let opts = CompileOptions {
        name: Some(format!("{}.cu", source.name)),
        // Exact expf/division/sqrt: these kernels are bandwidth-bound, accuracy is free.
        use_fast_math: Some(false),
        options: options(&arch.virtual_arch()),
        ..Default::default()
    };
    compile_ptx_with_opts(source.program(), opts)
}

/// What NVRTC says (warnings, remarks) when compiling `source` for `arch` with the options of
/// [`compile`]: `Ok(log)` if it compiled (an empty log when clean), `Err(log)` if not. For the
/// compile test, which [`compile`] cannot serve: cudarc drops the log of a successful compile.
/// Call [`ensure_loaded`] first.
pub fn compile_log(source: &KernelSource, arch: ComputeCapability) -> Result<String, String> {
    use cudarc::nvrtc::result;
    use std::ffi::{CStr, CString};

    let src = CString::new(source.program()).expect("no NUL in kernel sources");
    let name = CString::new(format!("{}.cu", source.name)).expect("no NUL in names");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| e.to_string())?;
    // SAFETY: `prog` is live until destroyed at the end; `src` and `name` outlive it.
    unsafe {
        let compiled = result::compile_program(prog, &options(&arch.virtual_arch()));
        let log = result::get_program_log(prog).map(|raw| {
            CStr::from_ptr(raw.as_ptr())
                .to_string_lossy()
                .trim()
                .to_owned()
        });
        let _ = result::destroy_program(prog);
        let log = log.map_err(|e| e.to_string())?;
        match compiled {
            Ok(()) => Ok(log),
            Err(e) => Err(format!("{e}: {log}")),
        }
    }
}
