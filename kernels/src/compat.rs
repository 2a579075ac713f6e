//! Which code a machine can run: the CUDA version each GPU architecture needs, what NVRTC
//! should produce for the device (a cubin for its exact architecture, else PTX the driver
//! compiles), and the refusals, each with what to install. Pure functions of the versions,
//! so they are tested without a GPU; `cuda::Kernels::load` and `cuda::Gemm::new` apply them.

use std::fmt;

/// A CUDA version, as `(major, minor)`: 12.8 is `Version(12, 8)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub i32, pub i32);

impl Version {
    /// From the driver's integer form: 12080 is 12.8.
    pub fn from_driver(v: i32) -> Self {
        Version(v / 1000, (v % 1000) / 10)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0, self.1)
    }
}

/// A GPU architecture as NVRTC numbers it: 90 for sm_90 (H100), 120 for sm_120 (RTX 50xx).
pub fn arch_code(major: u32, minor: u32) -> i32 {
    (major * 10 + minor) as i32
}

/// The first CUDA release that compiles for `arch` (`None`: not known here, newer than
/// this table).
pub fn first_cuda_for(arch: i32) -> Option<Version> {
    Some(match arch {
        ..=72 => Version(10, 0),
        75 => Version(10, 0),
        80 => Version(11, 0),
        86 => Version(11, 1),
        87 => Version(11, 4),
        89 | 90 => Version(11, 8),
        100 | 101 | 120 => Version(12, 8),
        103 | 121 => Version(12, 9),
        110 => Version(13, 0),
        _ => return None,
    })
}

/// A name a user recognises for an architecture.
fn arch_name(arch: i32) -> String {
    let family = match arch {
        80 => " (A100)",
        86 => " (RTX 30xx, A10)",
        89 => " (RTX 40xx, L4, L40)",
        90 => " (H100, H200)",
        100 => " (B200)",
        120 => " (RTX 50xx)",
        _ => "",
    };
    format!("sm_{arch}{family}")
}

/// What NVRTC is asked to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeTarget {
    /// Machine code for exactly this architecture: nothing left for the driver to compile.
    Cubin(i32),
    /// PTX for this (older) virtual architecture, which the driver compiles for the device:
    /// the NVRTC at hand does not know the device's own.
    Ptx(i32),
}

impl CodeTarget {
    /// The architecture the code is compiled for (`__CUDA_ARCH__` / 10): what decides which
    /// instructions the kernels may use, whatever the device is.
    pub fn arch(&self) -> i32 {
        match self {
            CodeTarget::Cubin(a) | CodeTarget::Ptx(a) => *a,
        }
    }

    /// NVRTC's `--gpu-architecture` value.
    pub fn nvrtc_arch(&self) -> String {
        match self {
            CodeTarget::Cubin(a) => format!("sm_{a}"),
            CodeTarget::Ptx(a) => format!("compute_{a}"),
        }
    }
}

/// What to compile for `device` with an NVRTC of version `nvrtc` that knows `nvrtc_archs`
/// under a driver for CUDA `driver`, or why this machine cannot run the kernels.
pub fn choose_target(
    device: i32,
    nvrtc: Version,
    nvrtc_archs: &[i32],
    driver: Version,
) -> Result<CodeTarget, String> {
    let name = arch_name(device);
    if let Some(needed) = first_cuda_for(device) {
        if driver < needed {
            return Err(format!(
                "{name} needs an NVIDIA driver for CUDA {needed} or newer; this driver supports \
                 CUDA {driver}: update the driver"
            ));
        }
    }
    if nvrtc_archs.contains(&device) {
        // A cubin from a newer major release than the driver's is refused at load.
        if nvrtc.0 > driver.0 {
            return Err(format!(
                "NVRTC {nvrtc} builds code for CUDA {}, and this driver supports CUDA {driver}: \
                 point INFER_NVRTC_LIB at an NVRTC {}.x, or update the driver",
                nvrtc.0, driver.0
            ));
        }
        return Ok(CodeTarget::Cubin(device));
    }
    let older = nvrtc_archs.iter().copied().filter(|&a| a < device).max();
    let needed = first_cuda_for(device).map_or_else(|| "a newer".into(), |v| v.to_string());
    match older {
        // The driver compiles PTX no newer than itself.
        Some(a) if nvrtc <= driver => Ok(CodeTarget::Ptx(a)),
        Some(_) => Err(format!(
            "NVRTC {nvrtc} does not know {name} and writes PTX too new for this driver \
             (CUDA {driver}): use NVRTC {needed} or newer (INFER_NVRTC_LIB)"
        )),
        None => Err(format!(
            "NVRTC {nvrtc} knows no architecture up to {name}: use NVRTC {needed} or newer \
             (INFER_NVRTC_LIB)"
        )),
    }
}

/// Whether cuBLAS `cublas` has kernels for `device`.
pub fn check_cublas(device: i32, cublas: Version) -> Result<(), String> {
    match first_cuda_for(device) {
        Some(needed) if cublas < needed => Err(format!(
            "cuBLAS {cublas} predates {} (CUDA {needed}): install cuBLAS {needed} or newer \
             (e.g. pip install 'nvidia-cublas-cu12>={needed}')",
            arch_name(device)
        )),
        _ => Ok(()),
    }
}

/// Whether kernels compiled for `code_arch` may be launched with programmatic dependent launch
/// on a `driver`: the wait each kernel begins with is compiled in only for sm_90 and newer
/// (below, a kernel launched early would read its inputs before they are written), and the
/// driver captures such launches into graphs from CUDA 12.3.
pub fn programmatic_launch(code_arch: i32, driver: Version) -> bool {
    code_arch >= 90 && driver >= Version(12, 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programmatic_launch_needs_sm90_code_and_a_12_3_driver() {
        assert!(programmatic_launch(90, Version(12, 3)));
        assert!(programmatic_launch(120, Version(13, 0)));
        assert!(
            !programmatic_launch(89, Version(13, 0)),
            "code without the waits"
        );
        assert!(!programmatic_launch(80, Version(12, 8)));
        assert!(
            !programmatic_launch(90, Version(12, 2)),
            "graphs cannot capture it"
        );
    }

    /// What NVRTC 12.4 and 12.8 know (nvrtcGetSupportedArchs).
    const NVRTC_12_4: [i32; 9] = [50, 52, 53, 60, 61, 62, 70, 72, 90];
    const NVRTC_12_8: [i32; 12] = [50, 60, 70, 75, 80, 86, 87, 89, 90, 100, 101, 120];

    #[test]
    fn driver_versions_read_as_cuda_does() {
        assert_eq!(Version::from_driver(12080), Version(12, 8));
        assert_eq!(Version::from_driver(11040), Version(11, 4));
        assert!(Version(12, 10) > Version(12, 8));
        assert_eq!(Version(12, 8).to_string(), "12.8");
    }

    #[test]
    fn a_known_architecture_gets_its_cubin() {
        let t = choose_target(90, Version(12, 8), &NVRTC_12_8, Version(12, 8));
        assert_eq!(t, Ok(CodeTarget::Cubin(90)));
        assert_eq!(t.unwrap().nvrtc_arch(), "sm_90");
        let t = choose_target(120, Version(12, 8), &NVRTC_12_8, Version(12, 9));
        assert_eq!(t, Ok(CodeTarget::Cubin(120)));
    }

    #[test]
    fn an_rtx_5080_on_an_old_driver_is_told_to_update_it() {
        let e = choose_target(120, Version(12, 8), &NVRTC_12_8, Version(12, 4)).unwrap_err();
        assert!(e.contains("sm_120 (RTX 50xx)"), "{e}");
        assert!(
            e.contains("CUDA 12.8 or newer") && e.contains("supports CUDA 12.4"),
            "{e}"
        );
    }

    #[test]
    fn an_nvrtc_that_predates_the_gpu_writes_ptx_for_the_driver() {
        // NVRTC 12.4 does not know sm_120: PTX for sm_90, compiled by the 12.8 driver.
        let t = choose_target(120, Version(12, 4), &NVRTC_12_4, Version(12, 8));
        assert_eq!(t, Ok(CodeTarget::Ptx(90)));
        assert_eq!(t.clone().unwrap().nvrtc_arch(), "compute_90");
        // The code's architecture, not the device's, decides the tensor-core prefill.
        assert_eq!(t.unwrap().arch(), 90);
        // Nothing at or below the device: refused, naming the NVRTC it needs.
        let e = choose_target(120, Version(11, 0), &[130], Version(12, 8)).unwrap_err();
        assert!(e.contains("use NVRTC 12.8 or newer"), "{e}");
    }

    #[test]
    fn code_newer_than_the_driver_is_refused() {
        // A CUDA 13 NVRTC's cubin needs a CUDA 13 driver.
        let e = choose_target(90, Version(13, 0), &[75, 80, 90, 120], Version(12, 8)).unwrap_err();
        assert!(e.contains("NVRTC 12.x"), "{e}");
        // PTX from an NVRTC newer than the driver cannot be compiled by it.
        let e = choose_target(120, Version(12, 9), &NVRTC_12_4, Version(12, 8)).unwrap_err();
        assert!(e.contains("too new for this driver"), "{e}");
    }

    #[test]
    fn cublas_must_know_the_gpu() {
        assert!(check_cublas(90, Version(12, 4)).is_ok());
        let e = check_cublas(120, Version(12, 4)).unwrap_err();
        assert!(e.contains("cuBLAS 12.4 predates sm_120"), "{e}");
        assert!(check_cublas(120, Version(12, 8)).is_ok());
        // An architecture newer than the table: no claim either way.
        assert!(check_cublas(150, Version(12, 0)).is_ok());
    }
}
