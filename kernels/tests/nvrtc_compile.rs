//! Compiles every kernel source through NVRTC to PTX for H100 (compute_90) and RTX 50xx
//! (compute_120). Needs libnvrtc but no GPU: run `kernels/fetch-nvrtc.sh` or set
//! `INFER_NVRTC_LIB`. Every source must compile without any NVRTC diagnostic (warnings
//! included). Without the library the test prints why and passes, so CI without the wheel stays
//! green.
#![cfg(feature = "cuda")]

use infer_kernels::cuda::nvrtc::{self, ComputeCapability};
use infer_kernels::cuda::sources;

#[test]
fn every_kernel_compiles_to_ptx() {
    let found = match nvrtc::ensure_loaded() {
        Ok(found) => found,
        Err(why) => {
            println!("SKIPPED nvrtc_compile: {why}");
            return;
        }
    };
    let (major, minor) = nvrtc::nvrtc_version();
    println!("NVRTC {major}.{minor} from {found}");

    let mut archs = vec![ComputeCapability::H100];
    // compute_120 (Blackwell consumer) arrived in CUDA 12.8.
    if (major, minor) >= (12, 8) {
        archs.push(ComputeCapability::RTX_50);
    } else {
        println!("NVRTC {major}.{minor} predates sm_120; compiling for compute_90 only");
    }
    for arch in archs {
        for source in sources::ALL {
            let ptx = nvrtc::compile(&source, arch).unwrap_or_else(|e| {
                panic!("{}.cu for {}: {e}", source.name, arch.virtual_arch());
            });
            let text = ptx.to_src();
            let target = format!(".target sm_{}{}", arch.major, arch.minor);
            assert!(
                text.contains(&target),
                "{}: PTX lacks `{target}`",
                source.name
            );
            for name in source.entry_points {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "{}.cu: PTX lacks entry {name}",
                    source.name
                );
            }
            // A clean compile: NVRTC has nothing to say (no warnings to ignore).
            let log = nvrtc::compile_log(&source, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                log.is_empty(),
                "{}.cu for {}: NVRTC diagnostics:\n{log}",
                source.name,
                arch.virtual_arch()
            );
            println!(
                "{}.cu -> {} PTX, {} bytes",
                source.name,
                arch.virtual_arch(),
                text.len()
            );
        }
    }
}
