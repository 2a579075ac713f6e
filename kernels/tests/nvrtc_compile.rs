//! Compiles every kernel source through NVRTC to PTX for H100 (compute_90) and RTX 50xx
//! (compute_120). Needs libnvrtc but no GPU: run `kernels/fetch-nvrtc.sh` or set
//! `INFER_NVRTC_LIB`. Every source must compile without any NVRTC diagnostic (warnings
//! included). Without the library the test prints why and passes, so CI without the wheel stays
//! green.
#![cfg(feature = "cuda")]

use infer_kernels::compat::CodeTarget;
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

/// What `Kernels::load` compiles: a cubin for the exact architecture (an ELF with every entry
/// point), for H100 and, where NVRTC knows it, RTX 50xx; and the second start reads the
/// cache rather than compiling.
#[test]
fn cubins_for_the_exact_architecture_and_their_cache() {
    if let Err(why) = nvrtc::ensure_loaded() {
        println!("SKIPPED nvrtc_compile: {why}");
        return;
    }
    let archs = nvrtc::supported_archs();
    assert!(archs.contains(&90), "NVRTC knows sm_90: {archs:?}");
    for arch in [90, 120].into_iter().filter(|a| archs.contains(a)) {
        for source in sources::ALL {
            let cubin = nvrtc::compile_to(&source, CodeTarget::Cubin(arch))
                .unwrap_or_else(|e| panic!("{}.cu for sm_{arch}: {e}", source.name));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{}.cu: a cubin is an ELF",
                source.name
            );
            for name in source.entry_points {
                assert!(
                    cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                    "{}.cu sm_{arch}: no {name}",
                    source.name
                );
            }
            println!(
                "{}.cu -> sm_{arch} cubin, {} bytes",
                source.name,
                cubin.len()
            );
        }
    }
    let dir = std::env::temp_dir().join(format!("infer-kernel-cache-{}", std::process::id()));
    let source = sources::KV_CACHE;
    let target = CodeTarget::Cubin(90);
    let first = nvrtc::compile_cached(&source, target, Some(&dir)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "one file, no temporaries: {files:?}");
    assert_eq!(std::fs::read(&files[0]).unwrap(), first);
    // The cache is what a second start gets: mark the file and read the mark back.
    std::fs::write(&files[0], b"from the cache").unwrap();
    let second = nvrtc::compile_cached(&source, target, Some(&dir)).unwrap();
    assert_eq!(second, b"from the cache");
    // Another target is another entry.
    nvrtc::compile_cached(&source, CodeTarget::Ptx(90), Some(&dir)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}
