//! The device API's header (`include/peercomm_device.h`) compiled as an engine would:
//! at run time with NVRTC through cudarc, from [`peercomm::device::prelude`], and the
//! device-api example's kernels with NVRTC and with nvcc. NVRTC
//! needs no GPU: this runs wherever libnvrtc loads (CI installs the pinned PyPI
//! `nvidia-cuda-nvrtc` beside nvcc; `PEERCOMM_NVRTC` names the library elsewhere), and
//! says so where it does not.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;

/// A file of the pinned wheels in `.venv-cuda` (`nvidia/cu13/<rel>`), or where `env`
/// names it.
fn toolchain_file(env: &str, rel: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p));
    }
    let lib = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.venv-cuda/lib")).ok()?;
    lib.flatten()
        .map(|python| python.path().join("site-packages/nvidia/cu13").join(rel))
        .find(|p| p.exists())
}

/// Loads libnvrtc and its builtins (beside it) once for the process: cudarc, and
/// NVRTC itself for the builtins, then find them by their sonames.
fn nvrtc_loaded(test: &str) -> bool {
    type Libs = Option<[libloading::Library; 2]>;
    static LIBS: std::sync::OnceLock<Libs> = std::sync::OnceLock::new();
    let lib = LIBS.get_or_init(|| {
        let path = toolchain_file("PEERCOMM_NVRTC", "lib/libnvrtc.so.13")?;
        let builtins = path.with_file_name("libnvrtc-builtins.so.13.0");
        // SAFETY: loading these libraries runs no initialiser with preconditions.
        unsafe {
            let builtins = libloading::Library::new(builtins).ok()?;
            Some([builtins, libloading::Library::new(path).ok()?])
        }
    });
    // SAFETY: probing the library names cudarc would load.
    let present = lib.is_some() && unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !present {
        common::announce_skip(test, "libnvrtc not found (PEERCOMM_NVRTC or .venv-cuda)");
    }
    present
}

/// A kernel of an engine's own on a DeviceComm: each rank adds its neighbours' parts of
/// the buffer after a publishing barrier, then ends, as the header's comment shows.
const USER_KERNEL: &str = r#"
extern "C" __global__ void neighbours(const peercomm::DeviceComm comm, float* out, unsigned long long n) {
    using namespace peercomm;
    auto b = make_ctx(comm);
    if (!enter(b)) return abandon(b, WaitForPeers::No);
    if (!barrier<BarrierKind::Publish>(b)) return abandon(b, WaitForPeers::Yes);
    const unsigned me = comm.group_rank, w = comm.group_width;
    const float* next = (const float*)peer_buffer(comm, (me + 1) % w);
    const float* prev = (const float*)peer_buffer(comm, (me + w - 1) % w);
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = next[i] + prev[i];
    if (!grid_barrier<BarrierKind::End>(b)) return abandon(b, WaitForPeers::Yes);
    finish(b);
}
"#;

/// A kernel on every memory operation of the header and a user kernel on the barrier,
/// compiled for sm_90 from the prelude alone: the PTX holds the system-scope orders the
/// names promise.
#[test]
fn the_device_header_compiles_with_nvrtc() {
    if !nvrtc_loaded("the_device_header_compiles_with_nvrtc") {
        return;
    }
    let kernel = r#"
extern "C" __global__ void touch(unsigned* word, peercomm::Vec16* pack, unsigned long long* t) {
    using namespace peercomm;
    const unsigned v = ld_acquire_sys(word) + ld_relaxed_sys(word + 1);
    st_relaxed_sys(word + 2, v);
    st_release_sys(word + 3, v);
    cas_relaxed_sys(word + 4, v, v + 1u);
    atomic_add_relaxed_dev(word + 5, 1u);
    const Vec16 x = ld_relaxed_sys_vec16(pack);
    st_release_sys_vec16(pack + 1, ld_volatile_vec16(pack + 2));
    st_relaxed_sys_vec16(pack + 3, x);
    st_volatile_vec16(pack + 4, make_vec16(1u, 2u, 3u, v));
    lamport_push(pack + 5, make_vec16(lamport_word_f32(v), 0u, 0u, kLamportSentinel));
    if (lamport_arrived(lamport_poll(pack + 6))) word[6] = LamportGeneration{v % 3u}.next();
    *t = timer_now() + timer_ticks(1000u);
}
"#;
    let source = format!("{}\n{kernel}\n{USER_KERNEL}", peercomm::device::prelude());
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some("sm_90"),
        options: vec!["-std=c++17".into()],
        ..Default::default()
    };
    let start = std::time::Instant::now();
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, options)
        .unwrap_or_else(|e| panic!("NVRTC: {e:?}"))
        .to_src();
    eprintln!("NVRTC compiled the device header in {:?}", start.elapsed());
    for op in [
        "ld.acquire.sys.global.u32",
        "ld.relaxed.sys.global.u32",
        "st.release.sys.global.u32",
        "atom.relaxed.sys.global.cas.b32",
        "st.release.sys.global.v4.u32",
        "%globaltimer",
        ".entry neighbours",
    ] {
        assert!(ptx.contains(op), "the PTX has no {op}");
    }
}

/// The device-api example's kernels (examples/device-api/kernels.cu): compiled with
/// NVRTC from the prelude, as the example does at run time, and with nvcc (the pinned
/// one in `.venv-cuda`, or `PEERCOMM_NVCC`) after `#include "peercomm_device.h"`.
#[test]
fn the_example_kernels_compile_with_nvrtc_and_nvcc() {
    let kernels = include_str!("../examples/device-api/kernels.cu");
    let names = [
        "one_stage_sum",
        "all_reduce_bias_gelu",
        "moe_combine",
        "bias_gelu",
    ];
    if nvrtc_loaded("the_example_kernels_compile_with_nvrtc_and_nvcc (NVRTC)") {
        let source = format!("{}\n{kernels}", peercomm::device::prelude());
        let options = cudarc::nvrtc::CompileOptions {
            arch: Some("sm_80"),
            options: vec!["-std=c++17".into()],
            ..Default::default()
        };
        let start = std::time::Instant::now();
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, options)
            .unwrap_or_else(|e| panic!("NVRTC: {e:?}"))
            .to_src();
        eprintln!(
            "NVRTC compiled the example's kernels in {:?}",
            start.elapsed()
        );
        for name in names {
            assert!(ptx.contains(&format!(".entry {name}")), "NVRTC: no {name}");
        }
    }
    let Some(nvcc) = toolchain_file("PEERCOMM_NVCC", "bin/nvcc") else {
        common::announce_skip(
            "the_example_kernels_compile_with_nvrtc_and_nvcc (nvcc)",
            "nvcc not found (PEERCOMM_NVCC or .venv-cuda)",
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("peercomm-device-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cu, ptx) = (dir.join("kernels.cu"), dir.join("kernels.ptx"));
    std::fs::write(&cu, format!("#include \"peercomm_device.h\"\n{kernels}")).unwrap();
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
    let out = std::process::Command::new(&nvcc)
        .args(["-std=c++17", "-arch=sm_80", "-ptx", "-I", include, "-o"])
        .arg(&ptx)
        .arg(&cu)
        .output()
        .expect("run nvcc");
    assert!(
        out.status.success(),
        "nvcc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ptx = std::fs::read_to_string(&ptx).unwrap();
    for name in names {
        assert!(ptx.contains(&format!(".entry {name}")), "nvcc: no {name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
