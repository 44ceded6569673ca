//! The reference suite on HIP (AMD GPUs), the no-GPU behaviour, and a check of the
//! ordering instructions the compiler emitted into the embedded code objects.
//!
//! Where no AMD GPU exists (CI, the NVIDIA machines) every GPU test prints why it is
//! skipped; the no-GPU and disassembly tests run everywhere the `hip` feature builds.
#![cfg(feature = "hip")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use peercomm::backend::hip::{embedded_code_objects, skipped_architectures, Hip};
use peercomm::backend::Backend;
use peercomm::unstable::HasExternalLibrary;
use peercomm::{CommConfig, Error, SingleController};

/// The AMD GPUs HIP sees, or why there are none (what `hipGetDeviceCount` said).
fn amd_gpus() -> Result<usize, String> {
    match Hip::device_count() {
        Ok(0) => Err("no AMD GPU: hipGetDeviceCount reported 0 devices".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("no AMD GPU: {e}")),
    }
}

reference_suite!(Hip, amd_gpus(), None, common::LENGTHS);

#[test]
fn no_gpu_gives_a_typed_error() {
    if let Ok(n) = amd_gpus() {
        common::announce_skip(
            "no_gpu_gives_a_typed_error",
            &format!("{n} AMD GPU(s) present"),
        );
        return;
    }
    for ordinals in [&[0usize][..], &[0, 1][..]] {
        match SingleController::<Hip>::new(ordinals, CommConfig::default()) {
            Err(e @ Error::NoDevice { .. }) => {
                eprintln!("no_gpu_gives_a_typed_error: {ordinals:?}: {e}");
                assert!(e.to_string().contains("hip"), "{e}");
            }
            Err(other) => panic!("expected Error::NoDevice, got {other:?}"),
            Ok(_) => panic!("a HIP communicator without an AMD GPU"),
        }
    }
    match Hip::open(0) {
        Err(Error::NoDevice { backend: "hip", .. }) => {}
        Err(other) => panic!("expected Error::NoDevice, got {other:?}"),
        Ok(_) => panic!("opened a HIP device without an AMD GPU"),
    }
}

#[test]
fn gfx90a_and_gfx942_are_embedded() {
    let targets: Vec<&str> = embedded_code_objects().map(|c| c.target).collect();
    for co in embedded_code_objects() {
        eprintln!(
            "embedded: {} ({} bytes) built by {}",
            co.target,
            co.bytes.len(),
            co.compiler
        );
    }
    for (arch, why) in skipped_architectures() {
        eprintln!("not built: {arch}: {why}");
    }
    if std::env::var_os("PEERCOMM_HIP_ARCHS").is_some() {
        common::announce_skip(
            "gfx90a_and_gfx942_are_embedded",
            "PEERCOMM_HIP_ARCHS chose the architectures",
        );
        return;
    }
    for arch in ["gfx90a", "gfx942"] {
        assert!(targets.contains(&arch), "{arch} missing from {targets:?}");
    }
}

// ---------------------------------------------------------------------------------
// Disassembly checks.

/// `llvm-objdump` new enough for gfx942 (LLVM 17+): `PEERCOMM_LLVM_OBJDUMP`, then
/// ROCm's, then Debian's llvm-19, then `llvm-objdump` on PATH.
fn find_tool(tool: &str) -> Option<PathBuf> {
    let env = format!("PEERCOMM_{}", tool.to_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&env) {
        return Some(PathBuf::from(p));
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            candidates.push(Path::new(&root).join("llvm/bin").join(tool));
        }
    }
    candidates.push(Path::new("/opt/rocm/llvm/bin").join(tool));
    candidates.push(Path::new("/usr/lib/llvm-19/bin").join(tool));
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            candidates.push(dir.join(format!("{tool}-19")));
            candidates.push(dir.join(tool));
        }
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// `llvm-objdump`, or `None` after a printed skip of `test`.
fn objdump_or_skip(test: &str) -> Option<PathBuf> {
    let found = find_tool("llvm-objdump");
    if found.is_none() {
        let why = "no llvm-objdump (install llvm-19, or set PEERCOMM_LLVM_OBJDUMP)";
        common::announce_skip(test, why);
    }
    found
}

/// Disassembly of one kernel, one normalised instruction per line (comments and
/// encodings dropped, spaces collapsed).
fn disassemble(objdump: &Path, code_object: &[u8], target: &str, symbol: &str) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!("peercomm-hip-disasm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.co", target.replace(':', "_")));
    std::fs::write(&path, code_object).unwrap();
    let out = Command::new(objdump)
        .arg("--disassemble")
        .arg(format!("--disassemble-symbols={symbol}"))
        .arg("--no-show-raw-insn")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", objdump.display()));
    assert!(
        out.status.success(),
        "{} failed on the {target} code object: {}",
        objdump.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<String> = text
        .lines()
        .skip_while(|l| !l.contains(&format!("<{symbol}>:")))
        .skip(1)
        .map(|l| l.split("//").next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert!(
        lines.len() > 20,
        "{target}: no disassembly for {symbol}:\n{text}"
    );
    lines
}

/// A test on one disassembled instruction.
type LineMatch = dyn Fn(&str) -> bool;

/// Indices `i` where `pattern[0]` matches line `i` and each further element matches a
/// later line, each within `gap` lines of the previous match.
fn find_sequences(lines: &[String], pattern: &[&LineMatch], gap: usize) -> Vec<usize> {
    let mut hits = Vec::new();
    'start: for i in 0..lines.len() {
        if !pattern[0](&lines[i]) {
            continue;
        }
        let mut at = i;
        for p in &pattern[1..] {
            match (at + 1..(at + 1 + gap).min(lines.len())).find(|&j| p(&lines[j])) {
                Some(j) => at = j,
                None => continue 'start,
            }
        }
        hits.push(i);
    }
    hits
}

/// What a system-scope release store and acquire load compile to (see the AMDGPU
/// memory model in LLVM's AMDGPUUsage), as this compiler emits them for
/// `__hip_atomic_store/load(.., __ATOMIC_RELEASE/ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM)`.
#[derive(Clone, Copy)]
struct Expected {
    /// Write back the L2 before the store.
    writeback: &'static str,
    /// Bits that make a global access system-coherent (bypass the non-coherent caches).
    system_bits: &'static [&'static str],
    /// Invalidation after the acquire load, in order.
    invalidate: &'static [&'static str],
}

fn expected(target: &str) -> Option<Expected> {
    match target.split(':').next()? {
        // MI200: glc loads, buffer_wbl2 before the release, L2 then L1 invalidation after
        // the acquire.
        "gfx90a" => Some(Expected {
            writeback: "buffer_wbl2",
            system_bits: &["glc"],
            invalidate: &["buffer_invl2", "buffer_wbinvl1_vol"],
        }),
        // MI300 / MI350 (gfx940 family): sc0 sc1 select system scope on loads, stores,
        // write-back and invalidation.
        "gfx942" | "gfx950" => Some(Expected {
            writeback: "buffer_wbl2 sc0 sc1",
            system_bits: &["sc0", "sc1"],
            invalidate: &["buffer_inv sc0 sc1"],
        }),
        _ => None,
    }
}

fn has_bits(line: &str, bits: &[&str]) -> bool {
    let words: Vec<&str> = line.split([' ', ',']).collect();
    bits.iter().all(|b| words.contains(b))
}

#[test]
fn barrier_disassembly_has_system_scope_ordering() {
    let Some(objdump) = objdump_or_skip("barrier_disassembly_has_system_scope_ordering") else {
        return;
    };
    let mut checked = Vec::new();
    for co in embedded_code_objects() {
        let Some(exp) = expected(co.target) else {
            eprintln!("{}: no expectations for this architecture", co.target);
            continue;
        };
        let lines = disassemble(&objdump, co.bytes, co.target, "peercomm_barrier_f32");
        let t = co.target;
        // Release: the L2 write-back, the wait for it, then the system-scope store.
        let writeback = move |l: &str| l == exp.writeback;
        let wait = |l: &str| l.starts_with("s_waitcnt") && l.contains("vmcnt(0)");
        // The arrival: counter and call descriptor in one 16-byte store.
        let store = move |l: &str| {
            l.starts_with("global_store_dwordx4 ")
                && (exp.system_bits == ["glc"] || has_bits(l, exp.system_bits))
        };
        let releases = find_sequences(&lines, &[&writeback, &wait, &store], 4);
        // Acquire: the system-scope load, the wait for it, then the invalidation(s).
        let load =
            move |l: &str| l.starts_with("global_load_dword ") && has_bits(l, exp.system_bits);
        let invalidates: Vec<Box<LineMatch>> = exp
            .invalidate
            .iter()
            .map(|&inv| Box::new(move |l: &str| l == inv) as Box<LineMatch>)
            .collect();
        let mut acquire: Vec<&LineMatch> = vec![&load, &wait];
        acquire.extend(invalidates.iter().map(|f| f.as_ref()));
        let acquires = find_sequences(&lines, &acquire, 3);
        assert!(
            !releases.is_empty(),
            "{t}: no `{}`, `s_waitcnt vmcnt(0)`, system-scope `global_store_dword` in the \
             barrier:\n{}",
            exp.writeback,
            lines.join("\n")
        );
        assert!(
            !acquires.is_empty(),
            "{t}: no system-scope `global_load_dword`, `s_waitcnt vmcnt(0)`, {:?} in the \
             barrier:\n{}",
            exp.invalidate,
            lines.join("\n")
        );
        // The publishing barrier: a release store of the arrival, soon after it the
        // system-scope spin on the peers' arrivals, and after that the acquire of the
        // counter word (the compiler may place it past the loop; the timeout record also
        // releases, but nothing spins after it).
        let spins: Vec<usize> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.starts_with("global_load_dwordx4 ") && has_bits(l, exp.system_bits))
            .map(|(i, _)| i)
            .collect();
        let paired = releases.iter().any(|&r| {
            spins.iter().any(|&s| s > r && s - r < 40) && acquires.iter().any(|&a| a > r)
        });
        assert!(
            paired,
            "{t}: no release store followed by an acquire spin (the end barrier):\n{}",
            lines.join("\n")
        );
        // The barriers spin with system-scope 16-byte loads of the arrival (the acquire
        // above reads its counter word once the spin has seen it).
        assert!(
            spins.len() > acquires.len(),
            "{t}: the start barrier's spin is not a system-scope load"
        );
        // Signal words are reached through global (not flat) instructions.
        assert!(
            !lines.iter().any(|l| l.starts_with("flat_")),
            "{t}: flat memory instructions in the barrier"
        );
        eprintln!(
            "{t}: barrier has {} release store(s) and {} acquire load(s) at system scope",
            releases.len(),
            acquires.len()
        );
        checked.push(t);
    }
    let missing: Vec<&str> = ["gfx90a", "gfx942"]
        .into_iter()
        .filter(|a| !checked.contains(a))
        .collect();
    if !missing.is_empty() {
        common::announce_skip(
            "barrier_disassembly_has_system_scope_ordering",
            &format!("not embedded in this build: {missing:?}"),
        );
    }
}

/// Whether a disassembled instruction touches scratch (private) memory: `scratch_*`
/// (gfx940 and later) or the buffer instructions through the scratch resource that
/// gfx90a spills with. The kernels move data with `global_*` only, so any buffer load
/// or store is a spill (`buffer_wbl2`, a cache write-back, is neither).
fn uses_scratch(line: &str) -> bool {
    line.starts_with("scratch_")
        || line.starts_with("buffer_store")
        || line.starts_with("buffer_load")
}

#[test]
fn data_kernels_move_16_byte_packs_and_use_no_scratch() {
    let Some(objdump) = objdump_or_skip("data_kernels_move_16_byte_packs_and_use_no_scratch")
    else {
        return;
    };
    for co in embedded_code_objects() {
        let Some(exp) = expected(co.target) else {
            continue;
        };
        let t = co.target;
        for dtype in ["f32", "f16", "bf16"] {
            // Lamport (the all-reduce and the fused kernel) spins with 16-byte loads that
            // bypass the caches.
            for family in ["lamport", "lamport_rmsnorm"] {
                let symbol = format!("peercomm_{family}_{dtype}");
                let lines = disassemble(&objdump, co.bytes, t, &symbol);
                assert!(
                    lines
                        .iter()
                        .any(|l| l.starts_with("global_load_dwordx4 ")
                            && has_bits(l, exp.system_bits)),
                    "{t}: {symbol} has no cache-bypassing 16-byte loads"
                );
                // Scratch would mean the argument struct (or a pack) went to memory.
                let scratch = lines.iter().any(|l| uses_scratch(l));
                assert!(!scratch, "{t}: {symbol} spills to scratch");
            }
            // The barriered all-reduces and the other collectives: packs, no scratch.
            for family in [
                "one_stage",
                "two_stage",
                "allreduce_group",
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "scatter",
                "allreduce_rmsnorm",
            ] {
                let symbol = format!("peercomm_{family}_{dtype}");
                let lines = disassemble(&objdump, co.bytes, t, &symbol);
                for op in ["global_load_dwordx4 ", "global_store_dwordx4 "] {
                    assert!(
                        lines.iter().any(|l| l.starts_with(op)),
                        "{t}: {symbol} has no {op}"
                    );
                }
                let scratch = lines.iter().any(|l| uses_scratch(l));
                assert!(!scratch, "{t}: {symbol} spills to scratch");
            }
        }
        eprintln!("{t}: 16-byte packs in one-stage, two-stage, Lamport and the collectives");
    }
}

/// Without RCCL (as in CI) the AMD fallback library is a typed error naming what was
/// tried, never a panic or a link failure: RCCL is opened at run time.
#[test]
fn missing_rccl_is_a_typed_error() {
    use peercomm::unstable::RCCL_LIBRARY_ENV;
    // The first use of RCCL in this process reads the variable: point it at nothing.
    std::env::set_var(RCCL_LIBRARY_ENV, "/nonexistent/librccl.so.1");
    let library = Hip::external_library();
    assert_eq!(library.name(), "rccl");
    match library.check_available() {
        Err(Error::ExternalUnavailable { library, detail }) => {
            assert_eq!(library, "rccl");
            assert!(detail.contains("/nonexistent/librccl.so.1"), "{detail}");
        }
        other => panic!("expected ExternalUnavailable, got {other:?}"),
    }
    // The single-controller form says the same, before touching any device.
    match library.single_controller(&[]) {
        Err(Error::ExternalUnavailable {
            library: "rccl", ..
        }) => {}
        Err(other) => panic!("expected ExternalUnavailable, got {other:?}"),
        Ok(_) => panic!("expected ExternalUnavailable, got handles"),
    }
}
