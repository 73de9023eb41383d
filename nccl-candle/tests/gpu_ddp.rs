//! nccl-candle's data-parallel pieces on real GPUs, in the shapes of nccl-rs's GPU suite: one
//! rank per visible GPU where there are 2+, else two ranks sharing GPU 0 (NCCL 2.30+), each
//! on a thread of its own with a candle device and a communicator on that device's stream
//! (`common::on_ranks`), results checked against the host's computation on random
//! (integer-valued) data. What ran and what was skipped (and why) is said on stderr and in
//! the suite's ledger.
//!
//! Run on a GPU host: `cargo test --test gpu_ddp -- --include-ignored --test-threads=1`.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarMap, SGD};
use nccl::Comm;
use nccl_candle::ddp::{
    broadcast_vars, sorted_vars, DistributedOptimizer, GradientAverager, DEFAULT_BUCKET_BYTES,
};
use nccl_candle::Error;

mod common;
use common::host_f32;

/// Integer-valued f32 in [-8, 8) from a seed (xorshift), so sums are exact.
fn data(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 16) as f32 - 8.0
        })
        .collect()
}

/// Runs `body(rank, size, comm, device)` on every rank of this host's layout
/// (`common::on_ranks`), or says why not.
fn on_every_gpu(test: &'static str, body: impl Fn(usize, usize, &Comm, &Device) + Sync) {
    common::on_ranks(test, |comm, device| {
        body(comm.rank(), comm.size(), &comm, device);
        comm.synchronize().expect("synchronize");
    });
}

/// A variable of `dims` and `dtype` holding `data(seed)`.
fn var(seed: u64, dims: &[usize], dtype: DType, device: &Device) -> Var {
    let len = dims.iter().product();
    let t = Tensor::from_vec(data(seed, len), dims, device)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    Var::from_tensor(&t).unwrap()
}

/// A `VarMap` of the named variables.
fn var_map(vars: Vec<(&str, Var)>) -> VarMap {
    let map = VarMap::new();
    {
        let mut data = map.data().lock().unwrap();
        for (name, var) in vars {
            data.insert(name.to_string(), var);
        }
    }
    map
}

/// A variable's values as f32 on the host (bf16 and u32 hold these integers exactly).
fn values(var: &Var) -> Vec<f32> {
    host_f32(var.as_tensor())
}

const LAYOUT: [(&str, &[usize], DType); 5] = [
    ("block.0.weight", &[8, 16], DType::F32),
    ("block.0.bias", &[16], DType::F32),
    ("embed", &[3, 5, 7], DType::BF16),
    ("scale", &[1], DType::F32),
    ("step", &[4], DType::U32),
];

#[test]
#[ignore = "needs CUDA GPUs"]
fn broadcast_vars_gives_every_rank_the_roots_values() {
    on_every_gpu(
        "broadcast_vars_gives_every_rank_the_roots_values",
        |rank, size, comm, device| {
            // u32 from integers in [-8, 8): shifted to be non-negative.
            let map = var_map(
                LAYOUT
                    .iter()
                    .enumerate()
                    .map(|(i, &(name, dims, dtype))| {
                        let v = var(100 * i as u64 + rank as u64, dims, DType::F32, device);
                        let t = if dtype == DType::U32 {
                            (v.as_tensor() + 8.0).unwrap().to_dtype(dtype).unwrap()
                        } else {
                            v.as_tensor().to_dtype(dtype).unwrap()
                        };
                        (name, Var::from_tensor(&t).unwrap())
                    })
                    .collect(),
            );
            let root = size - 1;
            broadcast_vars(comm, &map, root).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for (name, var) in sorted_vars(&map) {
                let i = LAYOUT.iter().position(|l| l.0 == name).unwrap();
                let mut want = data(100 * i as u64 + root as u64, var.elem_count());
                if var.dtype() == DType::U32 {
                    want.iter_mut().for_each(|x| *x += 8.0);
                }
                assert_eq!(values(&var), want, "rank {rank}: {name}");
            }
        },
    );
}

/// Variables (all zeros) and, per rank, the gradients its loss gives them: `G_i(rank)` for
/// variable `i`, except that rank 0 has no gradient for variable 3.
const SHAPES: [&[usize]; 6] = [&[5, 7], &[33], &[4, 4, 4], &[2], &[100], &[3, 3]];

fn grad_of(i: usize, rank: usize, len: usize) -> Vec<f32> {
    data(1000 * i as u64 + rank as u64, len)
}

/// The mean over the ranks of variable `i`'s gradient, rank 0's missing one counting as
/// zeros, computed on the host.
fn host_mean(i: usize, size: usize, len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for r in 0..size {
        if i == 3 && r == 0 {
            continue;
        }
        for (s, g) in sum.iter_mut().zip(grad_of(i, r, len)) {
            *s += g;
        }
    }
    sum.iter().map(|s| s / size as f32).collect()
}

fn zero_vars(device: &Device) -> VarMap {
    var_map(
        SHAPES
            .iter()
            .enumerate()
            .map(|(i, dims)| {
                let name: &'static str = ["v0", "v1", "v2", "v3", "v4", "v5"][i];
                (name, Var::zeros(*dims, DType::F32, device).unwrap())
            })
            .collect(),
    )
}

/// This rank's gradients of the variables of `map` (named `v0..`).
fn local_grads(map: &VarMap, rank: usize, device: &Device) -> candle_core::backprop::GradStore {
    let mut loss = Tensor::zeros((), DType::F32, device).unwrap();
    for (name, var) in sorted_vars(map) {
        let i: usize = name[1..].parse().unwrap();
        if i == 3 && rank == 0 {
            continue;
        }
        let g = Tensor::from_vec(grad_of(i, rank, var.elem_count()), var.shape(), device).unwrap();
        loss = (loss + var.as_tensor().mul(&g).unwrap().sum_all().unwrap()).unwrap();
    }
    loss.backward().unwrap()
}

fn close(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs().max(1.0))
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn gradient_averager_averages_into_the_host_mean() {
    on_every_gpu(
        "gradient_averager_averages_into_the_host_mean",
        |rank, size, comm, device| {
            let map = zero_vars(device);
            // 64 f32 per bucket: several buckets, and v4 (100 elements) alone in one.
            let averager = GradientAverager::new(comm, &map, 256).unwrap();
            assert!(averager.buckets().len() >= 4, "{:?}", averager.buckets());
            let mut grads = local_grads(&map, rank, device);
            averager.average(&mut grads).unwrap();
            for (name, var) in sorted_vars(&map) {
                let i: usize = name[1..].parse().unwrap();
                let grad = grads
                    .get(var.as_tensor())
                    .unwrap_or_else(|| panic!("rank {rank}: no gradient for {name}"));
                assert_eq!(grad.dims(), var.dims());
                let got = host_f32(grad);
                let want = host_mean(i, size, var.elem_count());
                assert!(
                    close(&got, &want),
                    "rank {rank}: {name}: {got:?} vs {want:?}"
                );
            }
            // The default bucket size: everything in one bucket, same means.
            let averager = GradientAverager::new(comm, &map, DEFAULT_BUCKET_BYTES).unwrap();
            assert_eq!(averager.buckets().len(), 1);
            let mut grads = local_grads(&map, rank, device);
            averager.average(&mut grads).unwrap();
            let (name, var) = &sorted_vars(&map)[4];
            let got = host_f32(grads.get(var.as_tensor()).unwrap());
            assert!(close(&got, &host_mean(4, size, 100)), "rank {rank}: {name}");
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn distributed_optimizer_steps_with_the_mean_gradient() {
    on_every_gpu(
        "distributed_optimizer_steps_with_the_mean_gradient",
        |rank, size, comm, device| {
            let map = zero_vars(device);
            let sgd = SGD::new(map.all_vars(), 0.5).unwrap();
            let mut opt = DistributedOptimizer::with_bucket_bytes(comm, sgd, &map, 256).unwrap();
            opt.averager_mut().set_timing(true);
            let mut grads = local_grads(&map, rank, device);
            opt.step(&mut grads).unwrap();
            assert_eq!(opt.averager().timing().map(|t| t.calls), Some(1));
            for (name, var) in sorted_vars(&map) {
                let i: usize = name[1..].parse().unwrap();
                let want: Vec<f32> = host_mean(i, size, var.elem_count())
                    .iter()
                    .map(|g| -0.5 * g)
                    .collect();
                assert!(close(&values(&var), &want), "rank {rank}: {name}");
            }
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_that_differ_get_an_error_on_every_rank() {
    on_every_gpu(
        "ranks_that_differ_get_an_error_on_every_rank",
        |rank, size, comm, device| {
            let last = size - 1;
            let others: Vec<usize> = (1..size).collect();
            let base = || {
                vec![
                    ("a", var(1, &[4, 4], DType::F32, device)),
                    ("b", var(2, &[8], DType::F32, device)),
                ]
            };
            // An extra variable on rank 0: every other rank differs from it.
            let mut vars = base();
            if rank == 0 {
                vars.push(("c", var(3, &[2], DType::F32, device)));
            }
            match broadcast_vars(comm, &var_map(vars), 0) {
                Err(Error::Mismatch { ranks, .. }) => assert_eq!(ranks, others, "rank {rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
            // Another shape on the last rank.
            let mut vars = base();
            if rank == last {
                vars[1].1 = var(2, &[2, 4], DType::F32, device);
            }
            match GradientAverager::new(comm, &var_map(vars), 1024) {
                Err(Error::Mismatch { ranks, .. }) => assert_eq!(ranks, [last], "rank {rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
            // Another bucket size on the last rank.
            let bytes = if rank == last { 2048 } else { 1024 };
            match GradientAverager::new(comm, &var_map(base()), bytes) {
                Err(Error::Mismatch { ranks, .. }) => assert_eq!(ranks, [last], "rank {rank}"),
                other => panic!("rank {rank}: {other:?}"),
            }
            // A variable on the CPU on the last rank: its own error there, a refusal elsewhere.
            let mut vars = base();
            if rank == last {
                let cpu = Var::zeros(8, DType::F32, &Device::Cpu).unwrap();
                vars[1].1 = cpu;
            }
            match (rank == last, broadcast_vars(comm, &var_map(vars), 0)) {
                (true, Err(Error::Variable { name, .. })) => assert_eq!(name, "b"),
                (false, Err(Error::PeerRefused { ranks, .. })) => assert_eq!(ranks, [last]),
                (_, other) => panic!("rank {rank}: {other:?}"),
            }
            // A root past the ranks on rank 0 only.
            let root = if rank == 0 { size } else { 0 };
            match (rank, broadcast_vars(comm, &var_map(base()), root)) {
                (0, Err(Error::Argument { .. })) => {}
                (_, Err(Error::PeerRefused { ranks, .. })) if rank != 0 => {
                    assert_eq!(ranks, [0])
                }
                (_, other) => panic!("rank {rank}: {other:?}"),
            }
            // After all that the communicator still works, and nothing was broadcast.
            let map = var_map(vec![("a", var(10 + rank as u64, &[4], DType::F32, device))]);
            broadcast_vars(comm, &map, 0).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert_eq!(values(&sorted_vars(&map)[0].1), data(10, 4), "rank {rank}");
        },
    );
}

/// Issue 41, m5: a variable that no rank has a gradient for gets none after the averaging,
/// so AdamW leaves it as it is (no weight decay, no momentum), as on one GPU and in PyTorch
/// DDP; a variable with a gradient on rank 0 only gets the mean, zeros from the others.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_variable_no_rank_used_gets_no_gradient_and_stays_as_it_was() {
    on_every_gpu(
        "a_variable_no_rank_used_gets_no_gradient_and_stays_as_it_was",
        |rank, size, comm, device| {
            // "all": a gradient on every rank; "one": on rank 0 only; "none": on no rank.
            let map = || {
                var_map(vec![
                    ("all", var(1, &[8], DType::F32, device)),
                    ("none", var(2, &[6], DType::F32, device)),
                    ("one", var(3, &[5], DType::F32, device)),
                ])
            };
            let grads = |map: &VarMap| {
                let vars = sorted_vars(map);
                let of = |name: &str| &vars.iter().find(|(n, _)| n == name).unwrap().1;
                let g = |seed: u64, len: usize| Tensor::from_vec(data(seed, len), len, device);
                let mut loss = of("all")
                    .as_tensor()
                    .mul(&g(10 + rank as u64, 8).unwrap())
                    .and_then(|t| t.sum_all())
                    .unwrap();
                if rank == 0 {
                    let one = of("one").as_tensor().mul(&g(20, 5).unwrap()).unwrap();
                    loss = (loss + one.sum_all().unwrap()).unwrap();
                }
                loss.backward().unwrap()
            };
            // The averager alone, one bucket per variable and one for all.
            for bytes in [0, DEFAULT_BUCKET_BYTES] {
                let map = map();
                let vars = sorted_vars(&map);
                let averager = GradientAverager::new(comm, &map, bytes).unwrap();
                let mut store = grads(&map);
                averager.average(&mut store).unwrap();
                let grad = |i: usize| store.get(vars[i].1.as_tensor());
                let mean_all: Vec<f32> = (0..8)
                    .map(|e| (0..size).map(|r| data(10 + r as u64, 8)[e]).sum::<f32>())
                    .map(|s| s / size as f32)
                    .collect();
                let got = host_f32(grad(0).unwrap());
                assert!(close(&got, &mean_all), "rank {rank}: all: {got:?}");
                assert!(
                    grad(1).is_none(),
                    "rank {rank}, {bytes} B: a gradient for none"
                );
                let mean_one: Vec<f32> = data(20, 5).iter().map(|g| g / size as f32).collect();
                let got = host_f32(grad(2).unwrap());
                assert!(close(&got, &mean_one), "rank {rank}: one: {got:?}");
            }
            // AdamW with weight decay: "none" keeps its values exactly, step after step.
            let map = map();
            let params = ParamsAdamW {
                lr: 0.1,
                weight_decay: 0.5,
                ..Default::default()
            };
            let adamw = AdamW::new(map.all_vars(), params).unwrap();
            let mut opt = DistributedOptimizer::new(comm, adamw, &map).unwrap();
            for _ in 0..3 {
                opt.step(&mut grads(&map)).unwrap();
            }
            let vars = sorted_vars(&map);
            assert_eq!(values(&vars[1].1), data(2, 6), "rank {rank}: none moved");
            assert_ne!(
                values(&vars[0].1),
                data(1, 8),
                "rank {rank}: all did not move"
            );
            assert_ne!(
                values(&vars[2].1),
                data(3, 5),
                "rank {rank}: one did not move"
            );
        },
    );
}
