//! Registered captures on the per-rank `Comm`: `Comm::register_inputs_of` runs a pass
//! twice, registering between them the inputs the first pass staged, so the second
//! reads them in place (a graph capture on CUDA, eager calls here). Checked: in-place
//! reads (two-stage runs), results against f64 and the staged bits, registrations
//! ending with the value, and typed errors in step when ranks disagree.

use peercomm::backend::Backend;
use peercomm::bootstrap::BootstrapError;
use peercomm::{Algorithm, AllReduceOptions, CollectiveOptions, Comm, Error, ReduceOp};

use super::common;
use super::common::collectives::{assert_bits, expect_all_gather};
use super::{inputs, nan, seed, with_world, Placement};

pub(super) fn opts(a: Algorithm) -> AllReduceOptions {
    AllReduceOptions::new().algorithm(a)
}

/// One pass of five calls, outputs poisoned: one-stage f32; bf16 one-stage then
/// two-stage (only in-place reads run it); an input rank 0 shares with the first call;
/// an all-gather; an in-place two-stage all-reduce (refilled first).
pub fn second_pass_reads_in_place<B: Backend>(place: &Placement, world: usize) {
    let seed = seed("per_rank_capture_inputs_second_pass_reads_in_place");
    let (n, m, g) = (4099, 65_537, 1023);
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let a_in = inputs::<f32>(seed, 0, world, n);
        let b_in = inputs::<half::bf16>(seed, 1, world, m);
        let c_in = inputs::<f32>(seed, 2, world, n);
        let g_in = inputs::<f32>(seed, 3, world, g);
        let e_in = inputs::<f32>(seed, 4, world, m);
        let a = B::alloc_from(dev, &a_in[rank]).unwrap();
        let b = B::alloc_from(dev, &b_in[rank]).unwrap();
        let c = B::alloc_from(dev, &c_in[rank]).unwrap();
        let gs = B::alloc_from(dev, &g_in[rank]).unwrap();
        let mut e = B::alloc_from(dev, &e_in[rank]).unwrap();
        let mut o1 = B::alloc_buffer::<f32>(dev, n).unwrap();
        let mut o2 = B::alloc_buffer::<half::bf16>(dev, m).unwrap();
        let mut o3 = B::alloc_buffer::<f32>(dev, n).unwrap();
        let mut og = B::alloc_buffer::<f32>(dev, g * world).unwrap();
        let third: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                if r == 0 {
                    a_in[0].clone()
                } else {
                    c_in[r].clone()
                }
            })
            .collect();
        let before = comm.registrations();
        let mut pass = 0;
        let (algorithms, registered) = comm
            .register_inputs_of(|| {
                pass += 1;
                B::upload(dev, &nan::<f32>(n), &mut o1)?;
                B::upload(dev, &nan::<half::bf16>(m), &mut o2)?;
                B::upload(dev, &nan::<f32>(n), &mut o3)?;
                B::upload(dev, &nan::<f32>(g * world), &mut og)?;
                B::upload(dev, &e_in[rank], &mut e)?;
                let second = if pass == 1 {
                    Algorithm::OneStage
                } else {
                    Algorithm::TwoStage
                };
                comm.all_reduce_with(&a, &mut o1, &ReduceOp::Sum, &opts(Algorithm::OneStage))?;
                let b_ran = comm.all_reduce_with(&b, &mut o2, &ReduceOp::Sum, &opts(second))?;
                let third_input = if rank == 0 { &a } else { &c };
                comm.all_reduce_with(
                    third_input,
                    &mut o3,
                    &ReduceOp::Sum,
                    &AllReduceOptions::new(),
                )?;
                comm.all_gather_with(&gs, &mut og, &CollectiveOptions::new())?;
                let e_ran = comm.all_reduce_in_place_with(&mut e, &ReduceOp::Sum, &opts(second))?;
                comm.synchronize()?;
                Ok((b_ran, e_ran))
            })
            .unwrap();
        assert_eq!(pass, 2, "rank {rank}: the pass runs twice");
        let two = Algorithm::TwoStage;
        assert_eq!(algorithms, (two, two), "rank {rank}");
        // Rank 0's third call shares its first's buffer, its peers' do not: five.
        assert_eq!(registered.registered(), 5, "rank {rank}");
        assert_eq!(registered.in_place_calls(), 5, "rank {rank}");
        assert_eq!(registered.staged_calls(), 0, "rank {rank}");
        assert_eq!(comm.registrations().0, before.0 + 5, "rank {rank}");
        let everyone = |v: Vec<f32>| vec![v; world];
        let got1 = B::download(dev, &o1).unwrap();
        common::check_sums(&a_in, &everyone(got1.clone()), world, "one-stage, in place");
        let got2 = B::download(dev, &o2).unwrap();
        common::check_sums(&b_in, &vec![got2; world], world, "two-stage, in place");
        let got3 = B::download(dev, &o3).unwrap();
        common::check_sums(&third, &everyone(got3.clone()), world, "aliased input");
        let gathered = B::download(dev, &og).unwrap();
        let want = expect_all_gather(&g_in, world, rank);

        assert_bits(&gathered, &want, "all-gather");

        let got_e = B::download(dev, &e).unwrap();
        common::check_sums(&e_in, &everyone(got_e), world, "in-place two-stage");
        // The capture's registrations are the calls': an eager call on the same buffer
        // still stages (two-stage refused), and gives the same bits one-stage.
        match comm.all_reduce_with(&b, &mut o2, &ReduceOp::Sum, &opts(Algorithm::TwoStage)) {
            Err(Error::Unsupported(_)) => {}
            other => panic!("rank {rank}: an eager call read a capture's input: {other:?}"),
        }
        B::upload(dev, &nan::<f32>(n), &mut o1).unwrap();
        comm.all_reduce_with(&a, &mut o1, &ReduceOp::Sum, &opts(Algorithm::OneStage))
            .unwrap();
        B::upload(dev, &nan::<f32>(n), &mut o3).unwrap();
        let third_input = if rank == 0 { &a } else { &c };
        comm.all_reduce(third_input, &mut o3, &ReduceOp::Sum)
            .unwrap();
        comm.synchronize().unwrap();
        assert_bits(&B::download(dev, &o1).unwrap(), &got1, "staged one-stage");
        assert_bits(&B::download(dev, &o3).unwrap(), &got3, "staged aliased");
        drop(registered);
        let note = format!("rank {rank}: ended with the value");
        assert_eq!(comm.registrations(), before, "{note}");
    });
    eprintln!("per_rank_capture_inputs_second_pass_reads_in_place world {world}: 5 calls in place");
}

/// What one rank's pass does in a refusal case.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    /// One group-of-one all-reduce of 256 floats (no peer waits for it).
    Solo,
    /// Two of them.
    TwoSolos,
    /// One of 128 floats.
    SmallSolo,
    /// Fails before any call.
    Fails,
    /// Registers a buffer instead (`Comm::register`).
    Registers,
}

fn run_part<B: Backend>(comm: &Comm<B>, part: Part) -> Result<(), Error> {
    let dev = comm.device();
    let solo = AllReduceOptions::new().group_size(1);
    let len = if part == Part::SmallSolo { 128 } else { 256 };
    let a = B::alloc_from(dev, &vec![1.0f32; len]).unwrap();
    let b = B::alloc_from(dev, &vec![2.0f32; len]).unwrap();
    let mut out = B::alloc_buffer::<f32>(dev, len).unwrap();
    match part {
        Part::Fails => {
            return comm
                .register_inputs_of(|| -> Result<(), Error> {
                    Err(Error::InvalidConfig("this rank's pass failed".into()))
                })
                .map(drop)
        }
        Part::Registers => return comm.register(a).map(drop).map_err(|e| e.error),
        _ => {}
    }
    comm.register_inputs_of(|| {
        comm.all_reduce_with(&a, &mut out, &ReduceOp::Sum, &solo)?;
        if part == Part::TwoSolos {
            comm.all_reduce_with(&b, &mut out, &ReduceOp::Sum, &solo)?;
        }
        comm.synchronize()
    })
    .map(drop)
}

/// Disagreeing passes (one more call, another size, a failing pass, a registration
/// against a capture): the failing rank its own error, the others `CannotRegister` (or
/// `ExchangeMismatch`) naming it; nothing stays registered; a matching call works after.
pub fn disagreeing_passes_are_refused<B: Backend>(place: &Placement, world: usize) {
    let odd = world - 1;
    let cases = [
        (Part::TwoSolos, "one more call"),
        (Part::SmallSolo, "another size"),
        (Part::Fails, "a failed pass"),
        (Part::Registers, "a registration"),
    ];
    with_world::<B, _>(place, world, |rank, comm| {
        let before = comm.registrations();
        let dev = comm.device();
        for (odd_part, what) in cases {
            let part = if rank == odd { odd_part } else { Part::Solo };
            let got = run_part(&comm, part);
            match (&got, rank == odd, odd_part) {
                (Err(Error::InvalidConfig(_)), true, Part::Fails) => {}
                (
                    Err(Error::Bootstrap(BootstrapError::ExchangeMismatch { rank: r, .. })),
                    _,
                    Part::Registers,
                ) if *r == if rank == odd { 0 } else { odd } => {}
                (Err(Error::CannotRegister { rank: r, .. }), _, _) if *r == odd || rank == odd => {}
                _ => panic!("rank {rank}, {what}: {got:?}"),
            }
            assert_eq!(comm.registrations(), before, "rank {rank}, {what}");
            // Every rank still in step: a matching world call.
            let ones = B::alloc_from(dev, &[1.0f32; 64]).unwrap();
            let mut out = B::alloc_from(dev, &[f32::NAN; 64]).unwrap();
            comm.all_reduce(&ones, &mut out, &ReduceOp::Sum).unwrap();
            comm.synchronize().unwrap();
            assert_eq!(B::download(dev, &out).unwrap(), vec![world as f32; 64]);
        }
        // The same passes on every rank register, and the value ends them.
        let got = run_part(&comm, Part::TwoSolos);
        assert!(got.is_ok(), "rank {rank}: {got:?}");
        assert_eq!(comm.registrations(), before, "rank {rank}");
    });
}

/// `cycles` registered passes of one all-reduce, each value dropped: the
/// registrations end where they started, every sum right.
pub fn pass_cycles_leak_nothing<B: Backend>(place: &Placement, world: usize, cycles: usize) {
    with_world::<B, _>(place, world, |rank, comm| {
        let dev = comm.device();
        let before = comm.registrations();
        let send = B::alloc_from(dev, &[rank as f32 + 1.0; 1000]).unwrap();
        let mut out = B::alloc_buffer::<f32>(dev, 1000).unwrap();
        let want = (world * (world + 1) / 2) as f32;
        for cycle in 0..cycles {
            let ((), inputs) = comm
                .register_inputs_of(|| {
                    comm.all_reduce_with(
                        &send,
                        &mut out,
                        &ReduceOp::Sum,
                        &opts(Algorithm::OneStage),
                    )
                    .map(drop)
                })
                .unwrap();
            assert_eq!(inputs.in_place_calls(), 1);
            if cycle % 50 == 0 {
                comm.synchronize().unwrap();
                assert_eq!(B::download(dev, &out).unwrap(), vec![want; 1000]);
            }
        }
        comm.synchronize().unwrap();
        assert_eq!(comm.registrations(), before, "rank {rank}");
    });
}
