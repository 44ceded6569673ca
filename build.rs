//! Build script: the embedded device code of each enabled backend (nvcc for `cuda`,
//! a HIP compiler for `hip`). Without a GPU feature it does nothing: the signal layout's
//! Rust mirror is the committed `src/signal_bindings.rs` (scripts/check-bindings.sh
//! checks it against bindgen's output for the header).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The layout header the device code includes.
const HEADERS: &str = "include";
/// The device algorithms both kernel trees include (kernels-common/peercomm_kernels.h).
const COMMON_KERNELS: &str = "kernels-common";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // The device API's headers, for dependents' build scripts (DEP_PEERCOMM_INCLUDE).
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:include={}", manifest.join("include").display());
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let hip = env::var_os("CARGO_FEATURE_HIP").is_some();
    if !cuda && !hip {
        return;
    }
    println!("cargo:rerun-if-changed={HEADERS}");
    println!("cargo:rerun-if-changed={COMMON_KERNELS}");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    if docs_only() {
        // docs.rs: no device compiler there, and the API is all it needs.
        if cuda {
            std::fs::write(out_dir.join("peercomm_cuda.fatbin"), b"")
                .expect("write the empty fatbin");
            println!(
                "cargo:warning=peercomm: DOCS_RS is set: CUDA kernels not compiled (an empty \
                 fatbin is embedded; this build documents the API and cannot launch kernels)"
            );
        }
        if hip {
            hip_build::write_docs_only_manifest(&out_dir);
            println!(
                "cargo:warning=peercomm: DOCS_RS is set: HIP kernels not compiled (no code \
                 object is embedded; this build documents the API and cannot launch kernels)"
            );
        }
        return;
    }
    if cuda {
        build_cuda_kernels(&out_dir);
    }
    if hip {
        build_hip_kernels(&out_dir);
    }
}

/// Whether this is a documentation-only build: `DOCS_RS` is set, as docs.rs sets it.
/// docs.rs has no CUDA or HIP compiler (and no network), so device code is not
/// compiled: the CUDA fatbin and the HIP code-object list are embedded empty, which
/// keeps every item of `--features cuda,hip` compiling and documented. Such a build
/// cannot launch kernels (loading the empty fatbin is a driver error; HIP finds no code
/// object). `scripts/check-docs.sh` runs this build with no device compiler reachable.
fn docs_only() -> bool {
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    env::var_os("DOCS_RS").is_some()
}

/// Finds nvcc: `NVCC`, then `CUDA_HOME`/`CUDA_PATH`, then `PATH`, then the pinned
/// PyPI toolchain in `.venv-cuda` that `.ci/run` installs.
fn find_nvcc() -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = env::var_os(var) {
            let p = PathBuf::from(root).join("bin/nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    if let Some(paths) = env::var_os("PATH") {
        for dir in env::split_paths(&paths) {
            let p = dir.join("nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    let venv_lib = Path::new(".venv-cuda/lib");
    if let Ok(entries) = std::fs::read_dir(venv_lib) {
        for entry in entries.flatten() {
            let p = entry.path().join("site-packages/nvidia/cu13/bin/nvcc");
            if p.exists() {
                return Some(p);
            }
        }
    }
    for p in ["/usr/local/cuda/bin/nvcc"] {
        if Path::new(p).exists() {
            return Some(PathBuf::from(p));
        }
    }
    None
}

/// Compiles `kernels-cuda/peercomm.cu` (the CUDA layer over the shared algorithms in
/// `kernels-common/`) into one fatbin (SASS for each listed
/// architecture plus PTX of the newest) embedded by `src/backend/cuda.rs`.
fn build_cuda_kernels(out_dir: &Path) {
    println!("cargo:rerun-if-changed=kernels-cuda");
    println!("cargo:rerun-if-env-changed=PEERCOMM_CUDA_ARCHS");
    let nvcc = find_nvcc().unwrap_or_else(|| {
        panic!(
            "feature `cuda` needs nvcc and none was found (looked at NVCC, CUDA_HOME, CUDA_PATH, \
             PATH, .venv-cuda). Install the CUDA toolkit, or the pinned PyPI compiler:\n  \
             python3 -m venv .venv-cuda && .venv-cuda/bin/pip install \"nvidia-cuda-nvcc==13.0.88\" \
             \"nvidia-nvvm==13.0.88\" \"nvidia-cuda-crt==13.0.88\" \"nvidia-cuda-runtime==13.0.96\" \
             \"nvidia-cuda-cccl==13.0.85\""
        )
    });
    // Semicolon-separated compute capabilities, e.g. "80;90".
    let archs = env::var("PEERCOMM_CUDA_ARCHS").unwrap_or_else(|_| "80;90".to_string());
    let archs: Vec<&str> = archs.split(';').filter(|a| !a.is_empty()).collect();
    let newest = archs
        .iter()
        .max()
        .expect("PEERCOMM_CUDA_ARCHS lists an architecture");
    let mut cmd = Command::new(&nvcc);
    cmd.arg("-fatbin")
        // Uncompressed, as every nvcc before 13 left it: nvcc 13 compresses a large
        // fatbin by its own measure, which hides the kernel names that
        // `fatbin_exports_every_kernel` checks without a GPU.
        .arg("--compress-mode=none")
        // One thread per architecture: each takes minutes.
        .args(["--threads", "0"])
        .arg("-O3")
        .arg("-std=c++20")
        .arg("-Iinclude")
        .arg(format!("-I{COMMON_KERNELS}"))
        .arg("-o")
        .arg(out_dir.join("peercomm_cuda.fatbin"));
    for a in &archs {
        cmd.arg("-gencode")
            .arg(format!("arch=compute_{a},code=sm_{a}"));
    }
    cmd.arg("-gencode")
        .arg(format!("arch=compute_{newest},code=compute_{newest}"));
    cmd.arg("kernels-cuda/peercomm.cu");
    let output = out_dir.join("peercomm_cuda.fatbin");
    let key = kernel_cache::entry(&cmd, out_dir, &output);
    if !kernel_cache::restore(key.as_deref(), &output) {
        run(&mut cmd, "nvcc");
        kernel_cache::store(key, &cmd, out_dir, &output);
    }
}

fn build_hip_kernels(out_dir: &Path) {
    println!("cargo:rerun-if-changed=kernels-hip");
    // The HIP build is described in kernels-hip/README.md; see build_hip.rs.
    hip_build::build(out_dir);
}

fn run(cmd: &mut Command, what: &str) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("could not start {what} ({cmd:?}): {e}"));
    if !status.success() {
        panic!("{what} failed ({status}): {cmd:?}");
    }
}

#[path = "build_hip.rs"]
mod hip_build;

/// `PEERCOMM_KERNEL_CACHE`, when set, names a folder that keeps compiled device code
/// under a hash of the compiler command and every kernel source, so that builds of the
/// same sources under other profiles or feature sets (CI's test and clippy passes)
/// compile them once. Unset, nothing is kept.
mod kernel_cache {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// The folders whose files the device code is built from.
    const SOURCES: [&str; 4] = ["include", "kernels-common", "kernels-cuda", "kernels-hip"];

    /// Where the output of `cmd` over the sources as they are now is kept (`None`: no
    /// cache). Taken before compiling: `store` keeps the output only under this entry.
    pub fn entry(cmd: &Command, out_dir: &Path, output: &Path) -> Option<PathBuf> {
        println!("cargo:rerun-if-env-changed=PEERCOMM_KERNEL_CACHE");
        let dir = PathBuf::from(std::env::var_os("PEERCOMM_KERNEL_CACHE")?);
        // FNV-1a: stable across Rust releases, unlike std's hasher.
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut feed = |bytes: &[u8]| {
            for b in bytes {
                hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        // The compiler by its canonical path (a build that finds it through PATH, as the
        // candle integration's does, and one that finds it relative to the repository
        // share an entry), its arguments with this build's own folder left out (it
        // differs per profile), and the compiler's own file where it is one (a wrapper
        // script may change).
        let program = std::fs::canonicalize(cmd.get_program())
            .unwrap_or_else(|_| PathBuf::from(cmd.get_program()));
        feed(program.display().to_string().as_bytes());
        for arg in cmd.get_args() {
            let arg = arg.to_string_lossy();
            feed(arg.replace(&out_dir.display().to_string(), "").as_bytes());
            feed(&[0]);
        }
        feed(&std::fs::read(cmd.get_program()).unwrap_or_default());
        for folder in SOURCES {
            let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            files.sort();
            for f in files {
                feed(f.display().to_string().as_bytes());
                feed(&std::fs::read(&f).unwrap_or_default());
            }
        }
        let name = output.file_name()?.to_string_lossy().into_owned();
        Some(dir.join(format!("{hash:016x}-{name}")))
    }

    /// Copies the output kept at `key` to `output`; false when there is none.
    pub fn restore(key: Option<&Path>, output: &Path) -> bool {
        key.is_some_and(|kept| std::fs::copy(kept, output).is_ok())
    }

    /// Keeps `output`, which `cmd` has just written, at `key` (its entry taken before the
    /// compile), unless a source changed while it compiled: the output may then be of
    /// either version, and is not kept. Best effort: a cache that cannot be written only
    /// costs the next build a compile.
    pub fn store(key: Option<PathBuf>, cmd: &Command, out_dir: &Path, output: &Path) {
        if let Some(kept) = key.filter(|k| entry(cmd, out_dir, output).as_ref() == Some(k)) {
            let _ = std::fs::create_dir_all(kept.parent().unwrap_or(Path::new(".")));
            let partial = kept.with_extension("partial");
            if std::fs::copy(output, &partial).is_ok() {
                let _ = std::fs::rename(partial, kept);
            }
        }
    }
}
