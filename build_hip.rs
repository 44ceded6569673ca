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
//! 3. `hipcc` on `PATH` (Debian's is HIP 5.2 on clang 15: gfx90a, not gfx942);
//! 4. Debian's `clang++-19` with the system HIP headers and device libraries, for the
//!    architectures clang 15 lacks: a device-library folder is generated in `OUT_DIR`
//!    (links to the system bitcode plus `oclc_isa_version_<arch>.bc` derived from the
//!    gfx940 one with `llvm-dis-19`/`llvm-as-19`).
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
    /// Debian clang-19 without ROCm: needs a device-library folder with the ISA file.
    debian_device_libs: Option<DebianDeviceLibs>,
}

#[derive(Clone, Debug)]
struct DebianDeviceLibs {
    /// `/usr/lib/<multiarch>/amdgcn/bitcode`.
    system_dir: PathBuf,
    /// `llvm-dis` and `llvm-as` of the same LLVM as the compiler.
    llvm_dis: PathBuf,
    llvm_as: PathBuf,
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
             /opt/rocm/bin/hipcc (and llvm/bin/clang++ under each), hipcc on PATH, clang++-19 \
             with Debian's HIP headers.\n\
             - On a ROCm 6/7 machine: set ROCM_PATH (e.g. /opt/rocm) or HIP_PATH.\n\
             - On Debian 12: apt-get install hipcc libamdhip64-dev clang-19 lld-19 llvm-19 \
             (or run scripts/install-toolchains.sh).\n\
             - Or point PEERCOMM_HIPCC at a hipcc or a HIP-capable clang++.\n\
             See docs/amd.md.\n"
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
            debian_device_libs: None,
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
                debian_device_libs: None,
            });
        } else if clang.is_file() {
            out.push(Toolchain {
                label: format!("{} ({name})", clang.display()),
                program: clang,
                args: vec![format!("--rocm-path={}", root.display())],
                debian_device_libs: None,
            });
        }
    }
    if let Some(hipcc) = which("hipcc") {
        out.push(Toolchain {
            label: format!("{} (PATH)", hipcc.display()),
            program: hipcc,
            args: Vec::new(),
            debian_device_libs: None,
        });
    }
    if let Some(tc) = debian_clang19() {
        out.push(tc);
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

/// Debian 12's clang-19 over the HIP 5.2 headers and device libraries in /usr.
fn debian_clang19() -> Option<Toolchain> {
    if !Path::new("/usr/include/hip/hip_runtime.h").is_file() {
        return None;
    }
    let program = which("clang++-19").or_else(|| {
        let p = PathBuf::from("/usr/lib/llvm-19/bin/clang++");
        p.is_file().then_some(p)
    })?;
    let system_dir = std::fs::read_dir("/usr/lib")
        .ok()?
        .flatten()
        .map(|e| e.path().join("amdgcn/bitcode"))
        .find(|p| p.join("ocml.bc").is_file())?;
    let tool = |name: &str| {
        which(&format!("{name}-19")).or_else(|| {
            let p = PathBuf::from(format!("/usr/lib/llvm-19/bin/{name}"));
            p.is_file().then_some(p)
        })
    };
    let (llvm_dis, llvm_as) = (tool("llvm-dis")?, tool("llvm-as")?);
    Some(Toolchain {
        label: format!(
            "{} (Debian, generated device-library folder)",
            program.display()
        ),
        program,
        args: vec!["--rocm-path=/usr".into()],
        debian_device_libs: Some(DebianDeviceLibs {
            system_dir,
            llvm_dis,
            llvm_as,
        }),
    })
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
        let mut args = tc.args.clone();
        if let Some(libs) = &tc.debian_device_libs {
            match debian_device_lib_dir(libs, arch, out_dir) {
                Ok(dir) => args.push(format!("--rocm-device-lib-path={}", dir.display())),
                Err(e) => {
                    let _ = writeln!(failures, "  {}: {e}", tc.label);
                    continue;
                }
            }
        }
        let mut cmd = Command::new(&tc.program);
        cmd.args(&args)
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
        if super::kernel_cache::restore(&cmd, out_dir, &output) {
            return Ok((output, tc.label.clone()));
        }
        match cmd.output() {
            Ok(o) if o.status.success() && output.is_file() => {
                super::kernel_cache::store(&cmd, out_dir, &output);
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

/// `OUT_DIR/amdgcn-bitcode`: links to Debian's device libraries plus, where missing,
/// `oclc_isa_version_<N>.bc` for `arch`, derived from the gfx940 file by changing the
/// ISA version constant (e.g. 9400 -> 9402 for gfx942). Only gfx9 parts are derived.
fn debian_device_lib_dir(
    libs: &DebianDeviceLibs,
    arch: &str,
    out_dir: &Path,
) -> Result<PathBuf, String> {
    let processor = arch.split(':').next().unwrap_or(arch);
    let digits = processor
        .strip_prefix("gfx")
        .ok_or_else(|| format!("`{arch}` is not a gfx target"))?;
    let dir = out_dir.join("amdgcn-bitcode");
    std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let entries = std::fs::read_dir(&libs.system_dir)
        .map_err(|e| format!("read {}: {e}", libs.system_dir.display()))?;
    for entry in entries.flatten() {
        let link = dir.join(entry.file_name());
        // Architectures compile in parallel and fill the same folder: a link another
        // thread made between the check and the call is fine.
        if std::fs::symlink_metadata(&link).is_err() {
            match std::os::unix::fs::symlink(entry.path(), &link) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(format!("link {}: {e}", link.display())),
            }
        }
    }
    let isa_file = dir.join(format!("oclc_isa_version_{digits}.bc"));
    if isa_file.exists() {
        return Ok(dir);
    }
    // gfx9XY: major 9, minor X, stepping Y (hex digits): version 9000 + 100*X + Y.
    let chars: Vec<char> = digits.chars().collect();
    let (minor, stepping) = match chars.as_slice() {
        ['9', m, s] => (
            m.to_digit(16).ok_or("bad minor digit")?,
            s.to_digit(16).ok_or("bad stepping digit")?,
        ),
        _ => {
            return Err(format!(
                "no device library for {arch} and only gfx9 ones are derived"
            ))
        }
    };
    let version = 9000 + 100 * minor + stepping;
    let template = libs.system_dir.join("oclc_isa_version_940.bc");
    if !template.is_file() {
        return Err(format!("{} is missing", template.display()));
    }
    let dis = Command::new(&libs.llvm_dis)
        .arg(&template)
        .arg("-o")
        .arg("-")
        .output()
        .map_err(|e| format!("run {}: {e}", libs.llvm_dis.display()))?;
    if !dis.status.success() {
        return Err(format!(
            "{} failed on {}",
            libs.llvm_dis.display(),
            template.display()
        ));
    }
    let text = String::from_utf8_lossy(&dis.stdout);
    if !text.contains("i32 9400") {
        return Err(format!(
            "{} does not hold the constant 9400",
            template.display()
        ));
    }
    let patched = text.replace("i32 9400", &format!("i32 {version}"));
    // Written under a per-architecture temporary name, then renamed: compiles of
    // several architectures run in parallel.
    let tmp_ll = dir.join(format!("isa_{digits}.ll"));
    let tmp_bc = dir.join(format!("isa_{digits}.bc.tmp"));
    std::fs::write(&tmp_ll, patched.as_bytes())
        .map_err(|e| format!("write {}: {e}", tmp_ll.display()))?;
    let status = Command::new(&libs.llvm_as)
        .arg(&tmp_ll)
        .arg("-o")
        .arg(&tmp_bc)
        .status()
        .map_err(|e| format!("run {}: {e}", libs.llvm_as.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status})", libs.llvm_as.display()));
    }
    std::fs::rename(&tmp_bc, &isa_file)
        .map_err(|e| format!("rename to {}: {e}", isa_file.display()))?;
    let _ = std::fs::remove_file(&tmp_ll);
    Ok(dir)
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
