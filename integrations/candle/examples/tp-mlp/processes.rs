//! `--processes`: one process per rank, as engines run one process per GPU. The
//! launcher (the process the user started, not a rank) starts this same binary once per
//! rank with the same arguments, and hands each its rank, peercomm's id and NCCL's id
//! through the environment: never on the command line, which every local user can read
//! (`/proc/<pid>/cmdline`), since the ids hold secrets. The single-GPU reference goes
//! through a file of the launcher's. Each rank process prints its measurements as one
//! JSON line, which the launcher merges as it merges the threads'.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use candle_core::{Device, Tensor};
use cudarc::nccl::Id as NcclId;
use peercomm_candle::UniqueId;

use crate::{run_rank, setup, Args, BoxResult, RankCtx, RankPoint, Rendezvous};

/// Set in a rank's process: its rank. Its absence marks the launcher.
const RANK_ENV: &str = "PEERCOMM_TP_MLP_RANK";
/// peercomm's id, as text.
const ID_ENV: &str = "PEERCOMM_TP_MLP_ID";
/// NCCL's id, in hex (absent when NCCL is left out).
const NCCL_ENV: &str = "PEERCOMM_TP_MLP_NCCL_ID";
/// The file holding the single-GPU block's outputs.
const REFERENCE_ENV: &str = "PEERCOMM_TP_MLP_REFERENCE";
/// Prefix of the line on which a rank reports its measurements.
const RESULT_LINE: &str = "PEERCOMM_TP_MLP_RESULT ";

/// This process's rank, when the launcher started it as one.
pub fn rank_of_this_process() -> BoxResult<Option<usize>> {
    match std::env::var(RANK_ENV) {
        Ok(rank) => Ok(Some(
            rank.parse()
                .map_err(|_| format!("{RANK_ENV}={rank} is not a rank"))?,
        )),
        Err(_) => Ok(None),
    }
}

fn env(name: &str) -> BoxResult<String> {
    std::env::var(name).map_err(|_| format!("{name} is not set (the launcher sets it)").into())
}

/// Starts one process per rank and gathers what each measured, in rank order.
pub fn launch(
    args: &Args,
    id: &UniqueId,
    nccl_id: Option<&NcclId>,
    reference: &[Tensor],
) -> BoxResult<Vec<Vec<RankPoint>>> {
    // The launcher is not a rank: rank 0's process binds the id's address itself.
    id.release();
    let file = Reference::save(reference)?;
    let exe = std::env::current_exe()?;
    let mut children = vec![];
    for rank in 0..args.ranks {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1))
            .env(RANK_ENV, rank.to_string())
            .env(ID_ENV, id.to_string())
            .env(REFERENCE_ENV, &file.0)
            .stdout(Stdio::piped());
        if let Some(nccl) = nccl_id {
            cmd.env(NCCL_ENV, hex(nccl));
        }
        children.push(
            cmd.spawn()
                .map_err(|e| format!("starting rank {rank}: {e}"))?,
        );
    }
    // Each rank writes one line: waiting for them in turn fills no pipe.
    let mut per_rank = vec![];
    let mut failed = vec![];
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().find_map(|l| l.strip_prefix(RESULT_LINE));
        match (out.status.success(), line) {
            (true, Some(json)) => per_rank.push(serde_json::from_str(json)?),
            _ => failed.push(format!("rank {rank} ({})", out.status)),
        }
    }
    if !failed.is_empty() {
        return Err(format!("rank processes failed: {}", failed.join(", ")).into());
    }
    Ok(per_rank)
}

/// A rank's process: the same setup as the launcher's, its rank's share of the block,
/// its measurements printed as one line.
pub fn rank_main(args: &Args, rank: usize) -> BoxResult<()> {
    let setup = setup(args)?;
    let gpu = *setup
        .gpu_of_rank
        .get(rank)
        .ok_or_else(|| format!("rank {rank} of {}", args.ranks))?;
    let id: UniqueId = env(ID_ENV)?.parse()?;
    let nccl_id = match std::env::var(NCCL_ENV) {
        Ok(text) => Some(unhex(&text)?),
        Err(_) => None,
    };
    let reference = Reference::load(&env(REFERENCE_ENV)?, args.tokens.len())?;
    let ctx = RankCtx {
        rank,
        gpu,
        world: args.ranks,
        weights: &setup.weights,
        inputs: &setup.inputs,
        reference: &reference,
        id: &id,
        nccl_id,
        config: setup.config.clone(),
        sync: Rendezvous::Processes,
        args,
    };
    let points = run_rank(ctx)?;
    println!("{RESULT_LINE}{}", serde_json::to_string(&points)?);
    Ok(())
}

/// The launcher's file of the single-GPU outputs, removed when the ranks are done.
struct Reference(PathBuf);

impl Reference {
    fn save(outputs: &[Tensor]) -> BoxResult<Self> {
        let name = format!(
            "peercomm-tp-mlp-reference-{}.safetensors",
            std::process::id()
        );
        let path = std::env::temp_dir().join(name);
        let map: HashMap<String, Tensor> = outputs
            .iter()
            .enumerate()
            .map(|(k, t)| (k.to_string(), t.clone()))
            .collect();
        candle_core::safetensors::save(&map, &path)?;
        Ok(Reference(path))
    }

    fn load(path: &str, count: usize) -> BoxResult<Vec<Tensor>> {
        let mut map = candle_core::safetensors::load(path, &Device::Cpu)?;
        (0..count)
            .map(|k| {
                map.remove(&k.to_string())
                    .ok_or_else(|| format!("{path} holds no output {k}").into())
            })
            .collect()
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn hex(id: &NcclId) -> String {
    id.internal()
        .iter()
        .map(|&c| format!("{:02x}", c as u8))
        .collect()
}

fn unhex(text: &str) -> BoxResult<NcclId> {
    let bad = || format!("{NCCL_ENV} is not 256 hex digits");
    if text.len() != 256 || !text.is_ascii() {
        return Err(bad().into());
    }
    let mut internal = [0 as std::ffi::c_char; 128];
    for (k, byte) in internal.iter_mut().enumerate() {
        let b = u8::from_str_radix(&text[2 * k..2 * k + 2], 16).map_err(|_| bad())?;
        *byte = b as std::ffi::c_char;
    }
    Ok(NcclId::uninit(internal))
}
