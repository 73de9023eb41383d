//! Helpers of the tests: random data and the host's computation of a whole layer, and for
//! the GPU tests the ranks ([`on_ranks`]) in the shapes of nccl-rs's own GPU suite, whose
//! harness (`../tests/common/shape.rs`, `threaded.rs`) is reused as it is: one GPU per rank
//! where there are 2+, else two ranks sharing GPU 0 as one LSA team (NCCL 2.30+), and a
//! ledger of what ran and what was skipped, said on stderr past libtest's capture and
//! printed by `gpu_suite_summary`, which `../tests/gpu/candle.sh` runs after the tests.
#![allow(dead_code)] // each test crate uses its own part

use std::sync::Barrier;
use std::time::Duration;

use candle_core::{Device, Tensor};
use nccl::Comm;

#[path = "../../../tests/common/shape.rs"]
pub mod shape;
#[path = "../../../tests/common/threaded.rs"]
pub mod threaded;

/// What `shape` takes from the core harness's `procs` (the re-exec harness, which these
/// tests do not use).
pub mod procs {
    use std::time::{SystemTime, UNIX_EPOCH};

    /// A `(name, value)` pair of a child's environment.
    pub fn var(name: &str, value: impl ToString) -> (String, String) {
        (name.to_owned(), value.to_string())
    }

    /// Milliseconds since the Unix epoch.
    pub fn epoch_ms() -> u128 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
    }

    /// What `CUDA_VISIBLE_DEVICES` must say for a child to see exactly GPU `ordinal`.
    pub fn visible_gpu(ordinal: usize) -> String {
        match std::env::var("CUDA_VISIBLE_DEVICES") {
            Ok(list) if !list.trim().is_empty() => list
                .split(',')
                .nth(ordinal)
                .map(|entry| entry.trim().to_owned())
                .unwrap_or_else(|| panic!("CUDA_VISIBLE_DEVICES={list:?} has no entry {ordinal}")),
            _ => ordinal.to_string(),
        }
    }
}

/// How long a multi-rank GPU test may take before its process is aborted, saying which
/// test hung (a rank that failed while its peers wait in a collective).
pub const LIMIT: Duration = Duration::from_secs(300);

/// Runs `body(comm, device)` for every rank of this host's threaded layout
/// ([`shape::threaded`]: one GPU per rank where there are 2+, else two ranks sharing GPU 0,
/// NCCL 2.30+), each rank on a thread of its own with a candle device of its own stream and
/// a communicator on that stream (`Comm::init_all`); the device is synchronised after
/// `body`. Where no layout fits, says why ([`shape::skip`], on stderr and in the ledger) and
/// runs nothing; otherwise records how it runs ([`shape::ran`]). Returns whether it ran.
///
/// Ranks sharing GPU 0 share one CUDA context, whose pageable copies go through one staging
/// buffer: a rank that reads a tensor back while its stream waits in a collective for the
/// other rank can hold that buffer while the other rank's upload, and so its launch, waits
/// for it. Bodies synchronise the device before reading back ([`close`] does).
pub fn on_ranks(test: &'static str, body: impl Fn(Comm, &Device) + Sync) -> bool {
    match layout(test) {
        Some(layout) => {
            run(test, &layout, |comm, device, _| body(comm, device));
            true
        }
        None => false,
    }
}

/// This host's threaded layout for `test` (see [`on_ranks`]), recorded as run; else `None`,
/// said through [`shape::skip`].
pub fn layout(test: &'static str) -> Option<shape::Layout> {
    shape::setup();
    shape::threaded(test)
}

/// [`on_ranks`] on a `layout` of [`layout`], `body` also given a barrier of all the ranks.
pub fn run(
    test: &'static str,
    layout: &shape::Layout,
    body: impl Fn(Comm, &Device, &Barrier) + Sync,
) {
    run_on(test, layout, |d| Ok(Device::new_cuda_with_stream(d)?), body)
}

/// [`run`] on devices a CUDA graph can capture on
/// ([`nccl_candle::decode::capturable_device`]).
#[allow(dead_code)]
pub fn run_capturable(
    test: &'static str,
    layout: &shape::Layout,
    body: impl Fn(Comm, &Device, &Barrier) + Sync,
) {
    // SAFETY: the tests use these devices' tensors through candle and nccl-candle only, on
    // each device's one stream.
    run_on(
        test,
        layout,
        |d| unsafe { nccl_candle::decode::capturable_device(d) },
        body,
    )
}

fn run_on(
    test: &'static str,
    layout: &shape::Layout,
    make: impl Fn(usize) -> nccl_candle::Result<Device>,
    body: impl Fn(Comm, &Device, &Barrier) + Sync,
) {
    let _deadline = threaded::Deadline::new(test, LIMIT);
    let barrier = Barrier::new(layout.size());
    let devices: Vec<Device> = layout
        .devices
        .iter()
        .map(|&d| make(d).expect("a candle CUDA device"))
        .collect();
    devices.iter().for_each(warm_up);
    let streams: Vec<_> = devices
        .iter()
        .map(|d| d.as_cuda_device().unwrap().cuda_stream())
        .collect();
    let comms = Comm::init_all(&streams).expect("ncclCommInitAll");
    std::thread::scope(|scope| {
        for (comm, device) in comms.into_iter().zip(devices) {
            let (body, barrier) = (&body, &barrier);
            scope.spawn(move || {
                let rank = comm.rank();
                body(comm, &device, barrier);
                device
                    .synchronize()
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            });
        }
    });
}

/// Loads every candle kernel module on `device` before any rank enters a collective
/// ([`nccl_candle::load_kernels`]): with two ranks sharing GPU 0, a module loaded between the
/// ranks' collectives waits for the other rank's, which waits for this rank (seen on one
/// H200: `broadcast_vars`' test with a cast's first use in between; with eager CUDA loading
/// and only the ops these tests use warmed up, `layers_over_gpus_match_the_host` too).
fn warm_up(device: &Device) {
    nccl_candle::load_kernels(device).expect("candle's kernels");
}

/// Whether the loaded NCCL can run nccl-rs's shipped kernels; else says why not (skipped).
pub fn shipped_kernels_or_skip(test: &str) -> bool {
    let lib = match nccl::library::get() {
        Ok(lib) => lib,
        Err(e) => {
            shape::skip(test, &format!("NCCL does not load: {e}"));
            return false;
        }
    };
    if lib.version() < nccl::device::DEV_COMM_SINCE {
        shape::skip(
            test,
            &format!(
                "the shipped kernels need NCCL {}+, loaded {}",
                nccl::device::DEV_COMM_SINCE,
                lib.version()
            ),
        );
        return false;
    }
    true
}

/// Whether `err`, from making the shipped kernels, says these ranks cannot have them (not
/// one LSA team, no device API, an older NCCL): the test is then skipped, saying so once.
pub fn kernels_unavailable(test: &str, rank: usize, err: &nccl_candle::Error) -> bool {
    let unavailable = matches!(err, nccl_candle::Error::Nccl(e) if e.is_unsupported());
    if unavailable && rank == 0 {
        shape::skip(
            test,
            &format!("the shipped kernels refused these ranks: {err}"),
        );
    }
    unavailable
}

/// Values in [-1, 1) from a seed (xorshift).
pub fn data(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `x W^T + b` on the host, in f64: `x` `[rows, inp]`, `w` `[out, inp]`, `b` `[out]`.
pub fn host_linear(x: &[f32], w: &[f32], b: &[f32], inp: usize, out: usize) -> Vec<f32> {
    x.chunks(inp)
        .flat_map(|row| {
            (0..out).map(move |o| {
                let dot: f64 = (0..inp)
                    .map(|i| f64::from(row[i]) * f64::from(w[o * inp + i]))
                    .sum();
                (dot + f64::from(b[o])) as f32
            })
        })
        .collect()
}

/// Columns `range` of each row (of `width`) of `x`.
pub fn columns(x: &[f32], width: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    x.chunks(width)
        .flat_map(|row| row[range.clone()].to_vec())
        .collect()
}

/// `t`'s elements as f32 on the host, once its device has nothing left to do (see
/// [`on_ranks`]).
pub fn host_f32(t: &Tensor) -> Vec<f32> {
    t.device().synchronize().expect("synchronize");
    t.flatten_all()
        .and_then(|t| t.to_dtype(candle_core::DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .expect("a read-back")
}

/// Asserts that `got` holds `want` within `tolerance` per element.
pub fn close(got: &Tensor, want: &[f32], tolerance: f32, what: &str) {
    // Nothing left that waits for a peer when the copy starts (see `on_ranks`).
    got.device()
        .synchronize()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = got
        .flatten_all()
        .and_then(|t| t.to_dtype(candle_core::DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance,
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// The row-parallel epilogue on the host, in f64: `h = sum + residual` and its RMSNorm,
/// `h · weight / sqrt(mean(h²) + eps)`, per row of `weight.len()`.
pub fn host_add_rms_norm(
    sum: &[f32],
    residual: &[f32],
    weight: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let hidden = weight.len();
    let h: Vec<f64> = sum
        .iter()
        .zip(residual)
        .map(|(&s, &r)| f64::from(s) + f64::from(r))
        .collect();
    let normed = h
        .chunks(hidden)
        .flat_map(|row| {
            let mean = row.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
            let scale = 1.0 / (mean + f64::from(eps)).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(v, &w)| (v * scale * f64::from(w)) as f32)
        })
        .collect();
    (h.iter().map(|&v| v as f32).collect(), normed)
}

/// The tensor-parallel group of `comm`: plain NCCL, or (`lsa`) the shipped kernels through
/// `LsaCollectives` (`None` where these ranks cannot have them, said once).
#[allow(dead_code)]
pub fn group(test: &str, comm: Comm, lsa: bool) -> Option<nccl_candle::tp::TpGroup> {
    use nccl_candle::tp::{LsaCollectives, TpGroup};
    if !lsa {
        return Some(TpGroup::new(comm).unwrap());
    }
    let rank = comm.rank();
    match LsaCollectives::new(comm, 64 * 1024) {
        Ok(lsa) => Some(TpGroup::new(lsa).unwrap()),
        Err(e) if kernels_unavailable(test, rank, &e) => None,
        Err(e) => panic!("rank {rank}: the shipped kernels: {e}"),
    }
}
