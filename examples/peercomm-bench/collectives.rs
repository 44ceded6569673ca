//! `--collectives`: all-gather, reduce-scatter and broadcast against NCCL's, and the
//! fused all-reduce + residual + RMSNorm against peercomm's all-reduce followed by the
//! residual + RMSNorm kernel alone (the fused kernel over groups of one), and against
//! NCCL's all-reduce followed by the same kernel. bf16, whole world, eager and graph.
//!
//! Records: implementation "peercomm" or "nccl" (so the ratio column compares them),
//! mode "<eager|graph>-<collective>"; bytes is the whole message (the all-gather's
//! output, the reduce-scatter's input, the broadcast's message; tokens x hidden x 2
//! for the fused rows, whose mode names the hidden size). The fused rows are
//! "peercomm-fused" against "peercomm-unfused" and "nccl" (NCCL + the same kernel).

use cudarc::driver::CudaSlice;
use cudarc::nccl::{group_end, group_start, ReduceOp};
use half::bf16;
use peercomm::backend::cuda::Cuda;
use peercomm::CollectiveOptions;

use super::gpu::{capture, time_batches, with_tracking, Gpu};
use super::*;

type T = bf16;

fn calls_for(bytes: usize) -> usize {
    if bytes <= 1 << 20 {
        50
    } else {
        10
    }
}

/// Eager and graph time (us per call) of `call`, which enqueues one call on every rank.
fn time_both(gpu: &Gpu, args: &Args, calls: usize, mut call: impl FnMut()) -> (f64, f64) {
    let eager = time_batches(&gpu.streams, args.batches, calls, || {
        (0..calls).for_each(|_| call())
    });
    with_tracking(gpu, false);
    let graphs = capture(&gpu.streams, || (0..calls).for_each(|_| call()));
    let graph = time_batches(&gpu.streams, args.batches, calls, || {
        graphs.iter().for_each(|g| g.launch().unwrap())
    });
    drop(graphs);
    with_tracking(gpu, true);
    (eager, graph)
}

fn buffers(gpu: &Gpu, len: usize, values: Option<&[Vec<T>]>) -> Vec<CudaSlice<T>> {
    (0..gpu.comm.world_size())
        .map(|r| {
            let dev = gpu.comm.core(r).device();
            let mut b = Cuda::alloc_buffer::<T>(dev, len).unwrap();
            let fill = match values {
                Some(v) => v[r].clone(),
                None => vec![T::from_f32(f32::NAN); len],
            };
            Cuda::upload(dev, &fill, &mut b).unwrap();
            b
        })
        .collect()
}

fn download(gpu: &Gpu, bufs: &[CudaSlice<T>]) -> Vec<Vec<T>> {
    bufs.iter()
        .enumerate()
        .map(|(r, b)| Cuda::download(gpu.comm.core(r).device(), b).unwrap())
        .collect()
}

fn push(records: &mut Vec<Record>, at: At, imp: &str, what: &str, (eager, graph): (f64, f64)) {
    for (mode, t) in [("eager", eager), ("graph", graph)] {
        let r = record(at, imp, what, &format!("{mode}-{what}"), t);
        print_record(&r);
        records.push(r);
    }
}

/// Whether `got` holds the all-gather of `ins` (bit for bit) on every rank.
fn gathered(ins: &[Vec<T>], got: &[Vec<T>]) -> bool {
    let want: Vec<T> = ins.concat();
    got.iter()
        .all(|g| g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()))
}

/// Whether each rank's part is within bf16 rounding of the f64 sum.
fn scattered(ins: &[Vec<T>], got: &[Vec<T>]) -> bool {
    let world = ins.len();
    let n = ins[0].len();
    got.iter().enumerate().all(|(r, part)| {
        let range = peercomm::reduce_scatter_part(n, world, r);
        part.len() == range.len()
            && range.zip(part).all(|(e, x)| {
                let sum: f64 = ins.iter().map(|v| v[e].to_f32() as f64).sum();
                let abs: f64 = ins.iter().map(|v| (v[e].to_f32() as f64).abs()).sum();
                (x.to_f32() as f64 - sum).abs() <= 2f64.powi(-8) * sum.abs() + 1e-6 * abs + 1e-7
            })
    })
}

/// Records for every size up to 16 MiB, then the fused shapes.
pub fn run(gpu: &Gpu, args: &Args, sizes: &[usize]) -> Vec<Record> {
    let world = gpu.comm.world_size();
    let mut records = Vec::new();
    if world < 2 {
        println!("--collectives needs two ranks");
        return records;
    }
    let nccl = gpu.nccl_comms(world);
    let mut rng = rand::rngs::StdRng::from_os_rng();
    let opts = CollectiveOptions::new();
    println!("\ncollectives (bf16, whole world; ratio = peercomm / NCCL, same mode):");
    print_header();
    for &bytes in sizes.iter().filter(|&&b| b <= 16 << 20) {
        let total = bytes / 2;
        let n = total / world;
        if n == 0 {
            continue;
        }
        let at = At {
            dtype: DType::BF16,
            world,
            group: world,
            bytes: n * world * 2,
        };
        let calls = calls_for(bytes);
        let ins: Vec<Vec<T>> = (0..world).map(|_| fill::<T>(&mut rng, n)).collect();
        let full: Vec<Vec<T>> = (0..world).map(|_| fill::<T>(&mut rng, n * world)).collect();

        // All-gather: n per rank in, n x world out.
        let send = buffers(gpu, n, Some(&ins));
        let mut recv = buffers(gpu, n * world, None);
        let ag = |recv: &mut Vec<CudaSlice<T>>| {
            let i: Vec<TensorView<Cuda>> = send.iter().map(|b| TensorView::flat(b)).collect();
            let mut o: Vec<TensorViewMut<Cuda>> =
                recv.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
            gpu.comm.all_gather(&i, &mut o, &opts).unwrap();
        };
        ag(&mut recv);
        gpu.comm.synchronize().unwrap();
        if gathered(&ins, &download(gpu, &recv)) {
            push(
                &mut records,
                at,
                "peercomm",
                "all_gather",
                time_both(gpu, args, calls, || ag(&mut recv)),
            );
        } else {
            println!("peercomm all_gather {bytes} B: WRONG RESULT, not timed");
        }
        if let Some(comms) = nccl {
            let mut recv = buffers(gpu, n * world, None);
            let mut call = || {
                group_start().unwrap();
                for (r, c) in comms.iter().enumerate() {
                    c.all_gather(&send[r], &mut recv[r]).unwrap();
                }
                group_end().unwrap();
            };
            push(
                &mut records,
                at,
                "nccl",
                "all_gather",
                time_both(gpu, args, calls, &mut call),
            );
        }

        // Reduce-scatter: n x world per rank in, n out.
        let send = buffers(gpu, n * world, Some(&full));
        let mut recv = buffers(gpu, n, None);
        let rs = |recv: &mut Vec<CudaSlice<T>>| {
            let i: Vec<TensorView<Cuda>> = send.iter().map(|b| TensorView::flat(b)).collect();
            let mut o: Vec<TensorViewMut<Cuda>> =
                recv.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
            gpu.comm
                .reduce_scatter(&i, &mut o, &peercomm::ReduceOp::Sum, &opts)
                .unwrap();
        };
        rs(&mut recv);
        gpu.comm.synchronize().unwrap();
        if scattered(&full, &download(gpu, &recv)) {
            push(
                &mut records,
                at,
                "peercomm",
                "reduce_scatter",
                time_both(gpu, args, calls, || rs(&mut recv)),
            );
        } else {
            println!("peercomm reduce_scatter {bytes} B: WRONG RESULT, not timed");
        }
        if let Some(comms) = nccl {
            let mut recv = buffers(gpu, n, None);
            let mut call = || {
                group_start().unwrap();
                for (r, c) in comms.iter().enumerate() {
                    c.reduce_scatter(&send[r], &mut recv[r], &ReduceOp::Sum)
                        .unwrap();
                }
                group_end().unwrap();
            };
            push(
                &mut records,
                at,
                "nccl",
                "reduce_scatter",
                time_both(gpu, args, calls, &mut call),
            );
        }

        // Broadcast from rank 0: n x world elements.
        let mut recv = buffers(gpu, n * world, None);
        let bc = |recv: &mut Vec<CudaSlice<T>>| {
            let i = [TensorView::flat(&send[0])];
            let mut o: Vec<TensorViewMut<Cuda>> =
                recv.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
            gpu.comm.broadcast(&i, &mut o, 0, &opts).unwrap();
        };
        bc(&mut recv);
        gpu.comm.synchronize().unwrap();
        let got = download(gpu, &recv);
        if got.iter().all(|g| {
            g.iter()
                .zip(&full[0])
                .all(|(a, b)| a.to_bits() == b.to_bits())
        }) {
            push(
                &mut records,
                at,
                "peercomm",
                "broadcast",
                time_both(gpu, args, calls, || bc(&mut recv)),
            );
        } else {
            println!("peercomm broadcast {bytes} B: WRONG RESULT, not timed");
        }
        if let Some(comms) = nccl {
            let mut recv = buffers(gpu, n * world, None);
            let mut call = || {
                group_start().unwrap();
                for (r, c) in comms.iter().enumerate() {
                    c.broadcast((r == 0).then_some(&send[0]), &mut recv[r], 0)
                        .unwrap();
                }
                group_end().unwrap();
            };
            push(
                &mut records,
                at,
                "nccl",
                "broadcast",
                time_both(gpu, args, calls, &mut call),
            );
        }
    }
    records.extend(fused(gpu, args, nccl));
    records
}

/// The fused kernel against the unfused pairs at decode shapes and one prefill shape.
fn fused(gpu: &Gpu, args: &Args, nccl: Option<&[cudarc::nccl::Comm]>) -> Vec<Record> {
    let world = gpu.comm.world_size();
    let mut records = Vec::new();
    let mut rng = rand::rngs::StdRng::from_os_rng();
    // The fused kernel forced to each algorithm (Auto picks Lamport where it fits).
    let one_stage = CollectiveOptions::new().algorithm(Algorithm::OneStage);
    let lamport = CollectiveOptions::new().algorithm(Algorithm::Lamport);
    let alone = CollectiveOptions::new().group_size(1);
    let shapes = [1usize, 2, 4, 8, 16, 32, 64, 128, 256]
        .into_iter()
        .flat_map(|t| [(t, 4096usize), (t, 8192)])
        .chain([(2048, 8192)]);
    println!(
        "\nfused all-reduce + residual + RMSNorm (bf16; ratio = against NCCL + the same kernel):"
    );
    print_header();
    for (tokens, hidden) in shapes {
        let n = tokens * hidden;
        let at = At {
            dtype: DType::BF16,
            world,
            group: world,
            bytes: n * 2,
        };
        let what = format!("rmsnorm-h{hidden}");
        let calls = calls_for(n * 2);
        let x: Vec<Vec<T>> = (0..world).map(|_| fill::<T>(&mut rng, n)).collect();
        let res0: Vec<Vec<T>> = vec![fill::<T>(&mut rng, n); world];
        let w: Vec<Vec<T>> = vec![fill::<T>(&mut rng, hidden); world];
        let xs = buffers(gpu, n, Some(&x));
        let ws = buffers(gpu, hidden, Some(&w));
        let mut sum = buffers(gpu, n, None);
        let mut outs: Vec<Vec<Vec<T>>> = Vec::new();
        let variants: [&str; 4] = [
            "peercomm-fused",
            "peercomm-fused-lamport",
            "peercomm-unfused",
            "nccl",
        ];
        for imp in variants {
            if imp == "nccl" && nccl.is_none() {
                continue;
            }
            // The Lamport fused kernel needs the message and its header in one slot.
            if imp == "peercomm-fused-lamport" && n * 2 + 16 > args.lamport_slot_bytes {
                continue;
            }
            let mut res = buffers(gpu, n, Some(&res0));
            let mut out = buffers(gpu, n, None);
            let call = |res: &mut Vec<CudaSlice<T>>,
                        out: &mut Vec<CudaSlice<T>>,
                        sum: &mut Vec<CudaSlice<T>>| {
                let norm_input: &Vec<CudaSlice<T>> = match imp {
                    "peercomm-fused" | "peercomm-fused-lamport" => &xs,
                    "peercomm-unfused" => {
                        let i: Vec<TensorView<Cuda>> =
                            xs.iter().map(|b| TensorView::flat(b)).collect();
                        let mut o: Vec<TensorViewMut<Cuda>> =
                            sum.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                        gpu.comm
                            .all_reduce(
                                &i,
                                &mut o,
                                &peercomm::ReduceOp::Sum,
                                &AllReduceOptions::new(),
                            )
                            .unwrap();
                        sum
                    }
                    _ => {
                        group_start().unwrap();
                        for (r, c) in nccl.unwrap().iter().enumerate() {
                            c.all_reduce(&xs[r], &mut sum[r], &ReduceOp::Sum).unwrap();
                        }
                        group_end().unwrap();
                        sum
                    }
                };
                let i: Vec<TensorView<Cuda>> =
                    norm_input.iter().map(|b| TensorView::flat(b)).collect();
                let wt: Vec<TensorView<Cuda>> = ws.iter().map(|b| TensorView::flat(b)).collect();
                let mut rt: Vec<TensorViewMut<Cuda>> =
                    res.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                let mut o: Vec<TensorViewMut<Cuda>> =
                    out.iter_mut().map(|b| TensorViewMut::flat(b)).collect();
                let o2 = match imp {
                    "peercomm-fused" => &one_stage,
                    "peercomm-fused-lamport" => &lamport,
                    _ => &alone,
                };
                gpu.comm
                    .all_reduce_residual_rms_norm(&i, &mut rt, &wt, &mut o, 1e-6, o2)
                    .unwrap();
            };
            call(&mut res, &mut out, &mut sum);
            gpu.comm.synchronize().unwrap();
            outs.push(download(gpu, &out));
            let t = time_both(gpu, args, calls, || call(&mut res, &mut out, &mut sum));
            push(&mut records, at, imp, &what, t);
        }
        // The fused kernel and the peercomm pair give the same bits; NCCL's sum order
        // differs, so within bf16 rounding.
        let bitwise = |a: &Vec<Vec<T>>, b: &Vec<Vec<T>>| {
            a.iter()
                .zip(b)
                .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()))
        };
        // outs: one-stage fused, [Lamport fused,] the pair, [NCCL].
        let lamport_ran = n * 2 + 16 <= args.lamport_slot_bytes;
        let peer_outs = if lamport_ran { 3 } else { 2 };
        let same = outs[1..peer_outs].iter().all(|o| bitwise(&outs[0], o));
        let near = outs.get(peer_outs).is_none_or(|nc| {
            outs[0].iter().zip(nc).all(|(a, b)| {
                a.iter().zip(b).all(|(x, y)| {
                    (x.to_f32() - y.to_f32()).abs() <= 0.05 * (1.0 + y.to_f32().abs())
                })
            })
        });
        if !same || !near {
            println!("fused {tokens}x{hidden}: RESULTS DISAGREE (bitwise with the pair: {same}, near NCCL's: {near}); timings above are suspect");
        }
        let t = |imp: &str| {
            records
                .iter()
                .rev()
                .find(|r| {
                    r.implementation == imp && r.mode == format!("graph-{what}") && r.bytes == n * 2
                })
                .map(|r| r.latency_us)
        };
        if let (Some(f), Some(l), Some(u)) = (
            t("peercomm-fused"),
            t("peercomm-fused-lamport"),
            t("peercomm-unfused"),
        ) {
            println!(
                "fused {tokens}x{hidden} (graph): one-stage fused {f:.2} us, Lamport fused {l:.2} us, \
                 all-reduce + RMSNorm {u:.2} us; the pair / one-stage fused {:.2}, the pair / Lamport fused {:.2}",
                u / f,
                u / l
            );
        }
    }
    records
}
