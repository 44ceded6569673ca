//! HIP device-code build (feature `hip`): compiles `kernels-hip/peercomm.hip` (the HIP
//! layer over the shared algorithms in `kernels-common/`) into one bare code object per
//! AMD architecture and writes `hip_code_objects.rs`, which `src/backend/hip.rs`
//! includes to embed them (`include_bytes!`) and to pick the one matching the device's
//! `gcnArchName` at run time.
//!
//! Architectures: `PEERCOMM_HIP_ARCHS` (separated by `;`, `,` or spaces, e.g.
//! `gfx942` or `gfx90a;gfx942`) overrides the default, which is gfx90a (MI200) and
//! gfx942 (MI300), both required, plus gfx950 (MI350) where the compiler knows it.
//!
//! Compilers, tried in this order for each architecture until one builds it:
//! 1. `PEERCOMM_HIPCC`: a `hipcc` or a HIP-capable `clang++`, used as given;
//! 2. the ROCm installations named by `HIP_PATH`, `ROCM_PATH`, then `/opt/rocm`:
//!    `bin/hipcc`, else `llvm/bin/clang++ --rocm-path=<root>`;
//! 3. `hipcc` on `PATH`.
//!
//! (A Debian machine without ROCm, as in CI, builds through the repository's
//! `scripts/hipcc-debian.sh` given as `PEERCOMM_HIPCC`; see docs/amd.md.)
//!
//! `PEERCOMM_HIP_FLAGS` adds compiler flags (split at spaces) to every compile.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "kernels-hip/peercomm.hip";
/// Include directories: the layout header and the shared device algorithms.
const INCLUDE_DIRS: [&str; 2] = ["include", "kernels-common"];
/// Built by default; a failure is a build error.
const REQUIRED_DEFAULT: [&str; 2] = ["gfx90a", "gfx942"];
/// Built by default where the compiler supports it; skipped with a warning otherwise.
const OPTIONAL_DEFAULT: [&str; 1] = ["gfx950"];

/// One way of invoking a HIP compiler.
#[derive(Clone, Debug)]
struct Toolchain {
    /// For messages and for the embedded record of what built each code object.
    label: String,
    program: PathBuf,
    args: Vec<String>,
}

/// A built code object and the label of the compiler that built it, or why no
/// compiler could.
type CompileResult = Result<(PathBuf, String), String>;

/// Entry point called by build.rs when feature `hip` is on.
pub fn build(out_dir: &Path) {
    for var in [
        "PEERCOMM_HIP_ARCHS",
        "PEERCOMM_HIPCC",
        "PEERCOMM_HIP_FLAGS",
        "HIP_PATH",
        "ROCM_PATH",
        "PATH",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed={SOURCE}");
    for dir in INCLUDE_DIRS {
        println!("cargo:rerun-if-changed={dir}");
    }
    println!("cargo:rerun-if-changed=build_hip.rs");

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let source = manifest.join(SOURCE);
    let includes: Vec<PathBuf> = INCLUDE_DIRS.iter().map(|d| manifest.join(d)).collect();
    let (archs, overridden) = requested_archs();
    let toolchains = find_toolchains();
    if toolchains.is_empty() {
        panic!(
            "\n\nfeature `hip` needs a HIP compiler and none was found.\n\
             Looked at: PEERCOMM_HIPCC, $HIP_PATH/bin/hipcc, $ROCM_PATH/bin/hipcc, \
             /opt/rocm/bin/hipcc (and llvm/bin/clang++ under each), hipcc on PATH.\n\
             - On a ROCm 6/7 machine: set ROCM_PATH (e.g. /opt/rocm) or HIP_PATH.\n\
             - Or point PEERCOMM_HIPCC at a hipcc or a HIP-capable clang++.\n\
             See docs/amd.md (it also covers Debian's packages without ROCm).\n"
        );
    }
    let extra_flags: Vec<String> = env::var("PEERCOMM_HIP_FLAGS")
        .map(|f| f.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default();

    // One thread per architecture: each compile takes a couple of seconds.
    let results: Vec<(String, bool, CompileResult)> = std::thread::scope(|scope| {
        let handles: Vec<_> = archs
            .iter()
            .map(|(arch, required)| {
                let (toolchains, source, includes, extra_flags) =
                    (&toolchains, &source, &includes, &extra_flags);
                scope.spawn(move || {
                    let r = compile_arch(arch, toolchains, source, includes, extra_flags, out_dir);
                    (arch.clone(), *required, r)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("compile thread"))
            .collect()
    });

    let mut built = Vec::new();
    let mut skipped = Vec::new();
    for (arch, required, result) in results {
        match result {
            Ok((path, label)) => built.push((arch, path, label)),
            Err(why) if required => panic!(
                "\n\nfeature `hip`: no HIP compiler found here builds {arch}.\n{why}\n\
                 Set PEERCOMM_HIP_ARCHS to the architectures your compiler supports \
                 (e.g. PEERCOMM_HIP_ARCHS=gfx90a){}, or point ROCM_PATH / PEERCOMM_HIPCC at a \
                 newer ROCm. See docs/amd.md.\n",
                if overridden {
                    ""
                } else {
                    "; the default needs gfx90a and gfx942"
                }
            ),
            Err(why) => {
                // One entry per compiler tried: its label and first diagnostic.
                let summary = why
                    .lines()
                    .filter(|l| l.starts_with("  ") && !l.starts_with("    "))
                    .map(str::trim)
                    .collect::<Vec<_>>()
                    .join("; ");
                println!(
                    "cargo:warning=peercomm: {arch} not built, no compiler here supports it \
                     ({summary}); PEERCOMM_HIP_ARCHS chooses the architectures"
                );
                skipped.push((arch, summary));
            }
        }
    }
    write_manifest(out_dir, &built, &skipped);
}

/// Documentation-only build (`DOCS_RS`, see build.rs): no compiler is looked for and
/// nothing is compiled; the manifest embeds no code object and lists the default
/// architectures as skipped, so a run finds no code object and says why.
pub fn write_docs_only_manifest(out_dir: &Path) {
    let why = "not built: DOCS_RS documentation build (no device code)";
    let skipped: Vec<(String, String)> = REQUIRED_DEFAULT
        .iter()
        .chain(OPTIONAL_DEFAULT.iter())
        .map(|a| (a.to_string(), why.to_string()))
        .collect();
    write_manifest(out_dir, &[], &skipped);
}

/// The architectures to build and whether each is required; and whether the list came
/// from `PEERCOMM_HIP_ARCHS`.
fn requested_archs() -> (Vec<(String, bool)>, bool) {
    match env::var("PEERCOMM_HIP_ARCHS") {
        Ok(list) if !list.trim().is_empty() => {
            let mut archs: Vec<(String, bool)> = Vec::new();
            for a in list.split([';', ',', ' ']).filter(|a| !a.is_empty()) {
                let a = a.trim().to_string();
                if !a.starts_with("gfx")
                    || !a
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+-:".contains(c))
                {
                    panic!(
                        "PEERCOMM_HIP_ARCHS: `{a}` is not an AMD offload architecture \
                         (e.g. gfx942)"
                    );
                }
                if !archs.iter().any(|(x, _)| *x == a) {
                    archs.push((a, true));
                }
            }
            (archs, true)
        }
        _ => {
            let mut archs: Vec<(String, bool)> = REQUIRED_DEFAULT
                .iter()
                .map(|a| (a.to_string(), true))
                .collect();
            archs.extend(OPTIONAL_DEFAULT.iter().map(|a| (a.to_string(), false)));
            (archs, false)
        }
    }
}

fn find_toolchains() -> Vec<Toolchain> {
    let mut out: Vec<Toolchain> = Vec::new();
    if let Some(p) = env::var_os("PEERCOMM_HIPCC").filter(|p| !p.is_empty()) {
        let program = PathBuf::from(p);
        out.push(Toolchain {
            label: format!("{} (PEERCOMM_HIPCC)", program.display()),
            program,
            args: Vec::new(),
        });
    }
    let mut roots: Vec<(String, PathBuf)> = Vec::new();
    for var in ["HIP_PATH", "ROCM_PATH"] {
        if let Some(r) = env::var_os(var).filter(|r| !r.is_empty()) {
            roots.push((format!("${var}"), PathBuf::from(r)));
        }
    }
    roots.push(("/opt/rocm".into(), PathBuf::from("/opt/rocm")));
    for (name, root) in roots {
        let hipcc = root.join("bin/hipcc");
        let clang = root.join("llvm/bin/clang++");
        if hipcc.is_file() {
            out.push(Toolchain {
                label: format!("{} ({name})", hipcc.display()),
                program: hipcc,
                args: Vec::new(),
            });
        } else if clang.is_file() {
            out.push(Toolchain {
                label: format!("{} ({name})", clang.display()),
                program: clang,
                args: vec![format!("--rocm-path={}", root.display())],
            });
        }
    }
    if let Some(hipcc) = which("hipcc") {
        out.push(Toolchain {
            label: format!("{} (PATH)", hipcc.display()),
            program: hipcc,
            args: Vec::new(),
        });
    }
    // The same program reached twice (e.g. HIP_PATH=/usr and PATH) is tried once.
    let mut seen = Vec::new();
    out.retain(|t| {
        let key = (
            std::fs::canonicalize(&t.program).unwrap_or_else(|_| t.program.clone()),
            t.args.clone(),
        );
        if seen.contains(&key) {
            false
        } else {
            seen.push(key);
            true
        }
    });
    out
}

fn which(name: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// File-name-safe form of a target id (`gfx90a:xnack+` -> `gfx90a_xnack_`).
fn file_stem(arch: &str) -> String {
    arch.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Builds one architecture with the first toolchain that can; the error lists why
/// each toolchain failed.
fn compile_arch(
    arch: &str,
    toolchains: &[Toolchain],
    source: &Path,
    includes: &[PathBuf],
    extra_flags: &[String],
    out_dir: &Path,
) -> CompileResult {
    let output = out_dir.join(format!("peercomm_{}.co", file_stem(arch)));
    let mut failures = String::new();
    for tc in toolchains {
        let mut cmd = Command::new(&tc.program);
        cmd.args(&tc.args)
            .arg(format!("--offload-arch={arch}"))
            .args([
                "--cuda-device-only",
                "--no-gpu-bundle-output",
                "-O3",
                // C++20: the shared source specialises on the group width with
                // templated lambdas.
                "-std=c++20",
            ])
            .args(includes.iter().map(|d| format!("-I{}", d.display())))
            .args(extra_flags)
            .arg("-c")
            .arg(source)
            .arg("-o")
            .arg(&output);
        let key = super::kernel_cache::entry(&cmd, out_dir, &output);
        if super::kernel_cache::restore(key.as_deref(), &output) {
            return Ok((output, tc.label.clone()));
        }
        match cmd.output() {
            Ok(o) if o.status.success() && output.is_file() => {
                super::kernel_cache::store(key, &cmd, out_dir, &output);
                return Ok((output, tc.label.clone()));
            }
            Ok(o) => {
                let stderr = String::from_utf8_lossy(&o.stderr);
                // The first diagnostics say why (e.g. "invalid target ID 'gfx950'").
                let lines: Vec<String> = stderr
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .take(6)
                    .map(|l| {
                        // Keep diagnostics short: clang explains target ids at length.
                        let l = l.split("; format is").next().unwrap_or(l);
                        l.chars().take(160).collect()
                    })
                    .collect();
                let _ = writeln!(
                    failures,
                    "  {} ({}): {}",
                    tc.label,
                    o.status,
                    lines.join("\n    ")
                );
            }
            Err(e) => {
                let _ = writeln!(failures, "  {}: could not run: {e}", tc.label);
            }
        }
    }
    Err(failures)
}

/// `OUT_DIR/hip_code_objects.rs`: the embedded code objects and what was skipped.
fn write_manifest(
    out_dir: &Path,
    built: &[(String, PathBuf, String)],
    skipped: &[(String, String)],
) {
    let mut s = String::from("// Generated by build_hip.rs. Do not edit.\n");
    s.push_str("/// The code objects built for this binary: (target id, compiler, bytes).\n");
    s.push_str("pub(crate) static CODE_OBJECTS: &[(&str, &str, &[u8])] = &[\n");
    for (arch, path, label) in built {
        let file = path.file_name().expect("file name").to_string_lossy();
        let _ = writeln!(
            s,
            "    ({arch:?}, {label:?}, include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}\"))),"
        );
    }
    s.push_str("];\n");
    s.push_str("/// Default architectures the compilers here could not build: (target id, why).\n");
    s.push_str("pub(crate) static SKIPPED_ARCHS: &[(&str, &str)] = &[\n");
    for (arch, why) in skipped {
        let _ = writeln!(s, "    ({arch:?}, {why:?}),");
    }
    s.push_str("];\n");
    std::fs::write(out_dir.join("hip_code_objects.rs"), s).expect("write hip_code_objects.rs");
}
