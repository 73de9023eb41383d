//! Shared GPU test harness: every collective x every element type x every reduction x in and
//! out of place, on random data, checked against a reference computed on the host.
//!
//! A [`Ranks`] is the set of ranks this process drives: all of them (one process, `init_all`,
//! operations issued through a `Group`) or one (one process per GPU, plain `Comm` calls).
//! Every process generates every rank's input from the same seeds, so each can compute the
//! expected output of its own ranks.
//!
//! Past 600 lines on purpose: `run_case` keeps each collective's expected result next to the
//! call that produces it, which is what a reader checks; the process harness is in `procs`.

#![allow(dead_code)]

pub mod procs;
pub mod shape;
pub mod threaded;

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use nccl::{Comm, Group, NcclType, Operation, PreMulSum, ReduceOp, Reduction};

/// Test element types: conversions through `f64` and a comparison tolerance.
pub trait Elem: NcclType + std::fmt::Debug + Default {
    const INT: bool;
    const SIGNED: bool;
    /// Relative precision of the type (0 for integers).
    const EPS: f64;
    /// Largest integer magnitude the type represents exactly, for input ranges.
    const EXACT: i64;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! int_elem {
    ($($t:ty: $signed:expr),*) => {$(
        impl Elem for $t {
            const INT: bool = true;
            const SIGNED: bool = $signed;
            const EPS: f64 = 0.0;
            const EXACT: i64 = 100;
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
int_elem!(i8: true, u8: false, i32: true, u32: false, i64: true, u64: false);

impl Elem for f32 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / (1u64 << 23) as f64;
    const EXACT: i64 = 100;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for f64 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / (1u64 << 52) as f64;
    const EXACT: i64 = 100;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl Elem for half::f16 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / 1024.0;
    const EXACT: i64 = 100;
    fn from_f64(v: f64) -> Self {
        half::f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
}
impl Elem for half::bf16 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / 128.0;
    const EXACT: i64 = 100;
    fn from_f64(v: f64) -> Self {
        half::bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
}
impl Elem for float8::F8E4M3 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / 8.0;
    const EXACT: i64 = 16;
    fn from_f64(v: f64) -> Self {
        float8::F8E4M3::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        float8::F8E4M3::to_f64(&self)
    }
}
impl Elem for float8::F8E5M2 {
    const INT: bool = false;
    const SIGNED: bool = true;
    const EPS: f64 = 1.0 / 4.0;
    const EXACT: i64 = 8;
    fn from_f64(v: f64) -> Self {
        float8::F8E5M2::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        float8::F8E5M2::to_f64(&self)
    }
}

/// SplitMix64: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % ((hi - lo + 1) as u64)) as i64
    }
}

/// The reduction of a test case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Builtin(ReduceOp),
    /// Pre-multiplied sum with this host scalar.
    PreMulSum(f64),
}

impl Op {
    /// The built-in reductions and a pre-multiplied sum whose scalar is exact in `T`.
    pub fn all<T: Elem>() -> Vec<Op> {
        let mut ops: Vec<Op> = ReduceOp::ALL.iter().map(|&op| Op::Builtin(op)).collect();
        ops.push(Op::PreMulSum(if T::INT { 2.0 } else { 0.5 }));
        ops
    }
}

/// Random inputs whose reductions stay exact (or within EPS) in `T`.
pub fn input<T: Elem>(op: Option<Op>, seed: u64, len: usize) -> Vec<T> {
    let mut rng = Rng::new(seed);
    let (lo, hi): (i64, i64) = match op {
        Some(Op::Builtin(ReduceOp::Prod)) => (if T::SIGNED { -2 } else { 1 }, 2),
        Some(Op::Builtin(ReduceOp::Max | ReduceOp::Min)) | None => {
            (if T::SIGNED { -T::EXACT } else { 0 }, T::EXACT)
        }
        // Sums of up to 8 ranks stay exact.
        _ => {
            let bound = (T::EXACT / 4).clamp(2, 8);
            (if T::SIGNED { -bound } else { 0 }, bound)
        }
    };
    (0..len)
        .map(|_| {
            let mut v = rng.range(lo, hi);
            if matches!(op, Some(Op::Builtin(ReduceOp::Prod))) && v == 0 {
                v = 1;
            }
            T::from_f64(v as f64)
        })
        .collect()
}

/// The element-wise reduction of `inputs` (one per rank), computed in f64.
pub fn reduce_ref<T: Elem>(op: Op, inputs: &[Vec<T>]) -> Vec<f64> {
    let n = inputs.len() as f64;
    (0..inputs[0].len())
        .map(|i| {
            let vals = inputs.iter().map(|v| v[i].to_f64());
            match op {
                Op::Builtin(ReduceOp::Sum) => vals.sum(),
                Op::Builtin(ReduceOp::Prod) => vals.product(),
                Op::Builtin(ReduceOp::Max) => vals.fold(f64::MIN, f64::max),
                Op::Builtin(ReduceOp::Min) => vals.fold(f64::MAX, f64::min),
                Op::Builtin(ReduceOp::Avg) => {
                    let avg = vals.sum::<f64>() / n;
                    if T::INT {
                        avg.trunc()
                    } else {
                        avg
                    }
                }
                Op::PreMulSum(s) => vals.map(|v| v * s).sum(),
            }
        })
        .collect()
}

pub fn assert_close<T: Elem>(what: &str, got: &[T], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut bad = Vec::new();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        let tol = T::EPS * (w.abs() + 1.0) * 2.0;
        if (g - w).abs() > tol {
            bad.push((i, g, *w));
        }
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {} elements wrong, first: {:?}",
        bad.len(),
        got.len(),
        &bad[..bad.len().min(5)]
    );
}

pub fn to_f64<T: Elem>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// The ranks this process drives.
pub struct Ranks {
    pub comms: Vec<Comm>,
    pub size: usize,
}

impl Ranks {
    pub fn stream(&self, local: usize) -> &Arc<CudaStream> {
        self.comms[local].stream()
    }

    pub fn sync(&self) {
        for comm in &self.comms {
            comm.synchronize_timeout(Duration::from_secs(120))
                .unwrap_or_else(|e| panic!("rank {}: {e}", comm.rank()));
        }
    }
}

/// The collectives under test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Coll {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
    Ring,
}

impl Coll {
    pub const ALL: [Coll; 9] = [
        Coll::AllReduce,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::AllToAll,
        Coll::Gather,
        Coll::Scatter,
        Coll::Ring,
    ];
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
    }
    pub fn has_in_place(self) -> bool {
        !matches!(self, Coll::AllToAll | Coll::Ring)
    }
    /// The first NCCL version that has the collective (the crate refuses it on older ones).
    pub fn since(self) -> nccl::Version {
        match self {
            Coll::AllToAll | Coll::Gather | Coll::Scatter => nccl::Version::new(2, 28, 0),
            _ => nccl::Version::new(2, 0, 0),
        }
    }
}

/// What one rank puts in and expects out of one case.
struct RankCase<T> {
    send: Option<Vec<T>>,
    /// The receive buffer's initial contents (the in-place buffer's input for in place).
    recv: Option<Vec<T>>,
    /// Expected contents of the receive (or in-place) buffer, if this rank checks it.
    expect: Option<Vec<f64>>,
}

/// Runs one case on every rank this process drives and checks the results.
/// Returns the number of checked buffers.
pub fn run_case<T: Elem>(
    ranks: &Ranks,
    coll: Coll,
    op: Option<Op>,
    in_place: bool,
    count: usize,
    seed: u64,
) -> usize {
    let n = ranks.size;
    let root = n - 1;
    let label = format!(
        "{coll:?} {:?} {op:?} in_place={in_place} n={n}",
        T::DATA_TYPE
    );
    let input_len = match coll {
        Coll::ReduceScatter | Coll::AllToAll => n * count,
        Coll::Scatter => n * count,
        _ => count,
    };
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|r| {
            input::<T>(
                op,
                seed.wrapping_mul(1000).wrapping_add(r as u64),
                input_len,
            )
        })
        .collect();
    let garbage =
        |r: usize, len: usize| input::<T>(None, seed ^ 0xdead_beef ^ (r as u64) << 32, len);
    let reduced = op.map(|op| reduce_ref(op, &inputs));

    let cases: Vec<RankCase<T>> = ranks
        .comms
        .iter()
        .map(|comm| {
            let r = comm.rank();
            let own = inputs[r].clone();
            match (coll, in_place) {
                (Coll::AllReduce, false) => RankCase {
                    send: Some(own),
                    recv: Some(garbage(r, count)),
                    expect: reduced.clone(),
                },
                (Coll::AllReduce, true) => RankCase {
                    send: None,
                    recv: Some(own),
                    expect: reduced.clone(),
                },
                (Coll::Broadcast, false) => RankCase {
                    send: (r == root).then_some(own),
                    recv: Some(garbage(r, count)),
                    expect: Some(to_f64(&inputs[root])),
                },
                (Coll::Broadcast, true) => RankCase {
                    send: None,
                    recv: Some(if r == root { own } else { garbage(r, count) }),
                    expect: Some(to_f64(&inputs[root])),
                },
                (Coll::Reduce, false) => RankCase {
                    send: Some(own),
                    recv: (r == root).then(|| garbage(r, count)),
                    expect: if r == root { reduced.clone() } else { None },
                },
                (Coll::Reduce, true) => RankCase {
                    send: None,
                    recv: Some(own),
                    expect: if r == root { reduced.clone() } else { None },
                },
                (Coll::AllGather, ip) => {
                    let all: Vec<f64> = inputs.iter().flat_map(|v| to_f64(v)).collect();
                    if ip {
                        let mut buf = garbage(r, n * count);
                        buf[r * count..(r + 1) * count].copy_from_slice(&own);
                        RankCase {
                            send: None,
                            recv: Some(buf),
                            expect: Some(all),
                        }
                    } else {
                        RankCase {
                            send: Some(own),
                            recv: Some(garbage(r, n * count)),
                            expect: Some(all),
                        }
                    }
                }
                (Coll::ReduceScatter, ip) => {
                    let block = reduced.as_ref().unwrap()[r * count..(r + 1) * count].to_vec();
                    if ip {
                        // The result lands at rank * count; the rest of the buffer is scratch.
                        RankCase {
                            send: None,
                            recv: Some(own),
                            expect: Some(block),
                        }
                    } else {
                        RankCase {
                            send: Some(own),
                            recv: Some(garbage(r, count)),
                            expect: Some(block),
                        }
                    }
                }
                (Coll::AllToAll, _) => {
                    let want: Vec<f64> = (0..n)
                        .flat_map(|i| to_f64(&inputs[i][r * count..(r + 1) * count]))
                        .collect();
                    RankCase {
                        send: Some(own),
                        recv: Some(garbage(r, n * count)),
                        expect: Some(want),
                    }
                }
                (Coll::Gather, ip) => {
                    let all: Vec<f64> = inputs.iter().flat_map(|v| to_f64(v)).collect();
                    match (ip, r == root) {
                        (false, true) => RankCase {
                            send: Some(own),
                            recv: Some(garbage(r, n * count)),
                            expect: Some(all),
                        },
                        (false, false) => RankCase {
                            send: Some(own),
                            recv: None,
                            expect: None,
                        },
                        (true, true) => {
                            let mut buf = garbage(r, n * count);
                            buf[root * count..(root + 1) * count].copy_from_slice(&own);
                            RankCase {
                                send: None,
                                recv: Some(buf),
                                expect: Some(all),
                            }
                        }
                        (true, false) => RankCase {
                            send: None,
                            recv: Some(own),
                            expect: Some(to_f64(&inputs[r])),
                        },
                    }
                }
                (Coll::Scatter, ip) => {
                    let block = to_f64(&inputs[root][r * count..(r + 1) * count]);
                    match (ip, r == root) {
                        (false, true) => RankCase {
                            send: Some(own),
                            recv: Some(garbage(r, count)),
                            expect: Some(block),
                        },
                        (false, false) => RankCase {
                            send: None,
                            recv: Some(garbage(r, count)),
                            expect: Some(block),
                        },
                        (true, true) => RankCase {
                            send: None,
                            recv: Some(own),
                            expect: Some(to_f64(&inputs[root])),
                        },
                        (true, false) => RankCase {
                            send: None,
                            recv: Some(garbage(r, count)),
                            expect: Some(block),
                        },
                    }
                }
                (Coll::Ring, _) => {
                    let prev = (r + n - 1) % n;
                    RankCase {
                        send: Some(own),
                        recv: Some(garbage(r, count)),
                        expect: Some(to_f64(&inputs[prev])),
                    }
                }
            }
        })
        .collect();

    // Upload.
    let mut sends: Vec<Option<CudaSlice<T>>> = Vec::new();
    let mut recvs: Vec<Option<CudaSlice<T>>> = Vec::new();
    for (local, case) in cases.iter().enumerate() {
        let stream = ranks.stream(local);
        sends.push(case.send.as_ref().map(|v| stream.clone_htod(v).unwrap()));
        recvs.push(case.recv.as_ref().map(|v| stream.clone_htod(v).unwrap()));
    }
    let premuls: Vec<PreMulSum<'_, T>> = match op {
        Some(Op::PreMulSum(s)) => ranks
            .comms
            .iter()
            .map(|comm| PreMulSum::with_host_scalar(comm, T::from_f64(s)).unwrap())
            .collect(),
        _ => Vec::new(),
    };

    // Build one call per local rank.
    let mut calls = Vec::new();
    for (local, (send, recv)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
        let reduction: Reduction<'_, T> = match op {
            Some(Op::Builtin(b)) => b.into(),
            Some(Op::PreMulSum(_)) => (&premuls[local]).into(),
            None => ReduceOp::Sum.into(),
        };
        let r = ranks.comms[local].rank();
        let send_dyn = send.as_ref().map(|s| s as &dyn DevicePtr<T>);
        let mut calls_here: Vec<Operation<'_, T>> = Vec::new();
        match (coll, in_place) {
            (Coll::AllReduce, false) => calls_here.push(Operation::all_reduce(
                send.as_ref().unwrap(),
                recv.as_mut().unwrap(),
                reduction,
            )),
            (Coll::AllReduce, true) => calls_here.push(Operation::all_reduce_in_place(
                recv.as_mut().unwrap(),
                reduction,
            )),
            (Coll::Broadcast, false) => {
                calls_here.push(Operation::broadcast(send_dyn, recv.as_mut().unwrap(), root))
            }
            (Coll::Broadcast, true) => {
                calls_here.push(Operation::broadcast_in_place(recv.as_mut().unwrap(), root))
            }
            (Coll::Reduce, false) => calls_here.push(Operation::reduce(
                send.as_ref().unwrap(),
                recv.as_mut().map(|b| b as &mut dyn DevicePtrMut<T>),
                reduction,
                root,
            )),
            (Coll::Reduce, true) => calls_here.push(Operation::reduce_in_place(
                recv.as_mut().unwrap(),
                reduction,
                root,
            )),
            (Coll::AllGather, false) => calls_here.push(Operation::all_gather(
                send.as_ref().unwrap(),
                recv.as_mut().unwrap(),
            )),
            (Coll::AllGather, true) => {
                calls_here.push(Operation::all_gather_in_place(recv.as_mut().unwrap()))
            }
            (Coll::ReduceScatter, false) => calls_here.push(Operation::reduce_scatter(
                send.as_ref().unwrap(),
                recv.as_mut().unwrap(),
                reduction,
            )),
            (Coll::ReduceScatter, true) => calls_here.push(Operation::reduce_scatter_in_place(
                recv.as_mut().unwrap(),
                reduction,
            )),
            (Coll::AllToAll, _) => calls_here.push(Operation::all_to_all(
                send.as_ref().unwrap(),
                recv.as_mut().unwrap(),
            )),
            (Coll::Gather, false) => calls_here.push(Operation::gather(
                send.as_ref().unwrap(),
                recv.as_mut().map(|b| b as &mut dyn DevicePtrMut<T>),
                root,
            )),
            (Coll::Gather, true) => {
                calls_here.push(Operation::gather_in_place(recv.as_mut().unwrap(), root))
            }
            (Coll::Scatter, false) => {
                calls_here.push(Operation::scatter(send_dyn, recv.as_mut().unwrap(), root))
            }
            (Coll::Scatter, true) => {
                calls_here.push(Operation::scatter_in_place(recv.as_mut().unwrap(), root))
            }
            (Coll::Ring, _) => {
                calls_here.push(Operation::send(send.as_ref().unwrap(), (r + 1) % n));
                calls_here.push(Operation::recv(recv.as_mut().unwrap(), (r + n - 1) % n));
            }
        }
        calls.push(calls_here);
    }

    // Issue: one rank here and a single call goes straight through the communicator;
    // otherwise (several GPUs, or send + receive) through one group.
    if ranks.comms.len() == 1 && calls[0].len() == 1 {
        let call = calls.pop().unwrap().pop().unwrap();
        ranks.comms[0]
            .enqueue(call)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
    } else {
        let mut group = Group::start().unwrap();
        for (local, calls_here) in calls.into_iter().enumerate() {
            for call in calls_here {
                group
                    .enqueue(&ranks.comms[local], call)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
            }
        }
        group.finish().unwrap_or_else(|e| panic!("{label}: {e}"));
    }
    ranks.sync();
    drop(premuls);

    // Check.
    let mut checked = 0;
    for (local, case) in cases.iter().enumerate() {
        let Some(expect) = &case.expect else { continue };
        let stream = ranks.stream(local);
        let got: Vec<T> = stream.clone_dtoh(recvs[local].as_ref().unwrap()).unwrap();
        let r = ranks.comms[local].rank();
        let got = match (coll, in_place) {
            (Coll::ReduceScatter, true) => got[r * count..(r + 1) * count].to_vec(),
            _ => got,
        };
        assert_close(&format!("{label} rank {r}"), &got, expect);
        checked += 1;
    }
    checked
}

/// Checks that a collective the loaded NCCL lacks is refused with `Error::Unsupported`
/// naming its first version, before anything reaches NCCL.
fn assert_refused<T: Elem>(ranks: &Ranks, coll: Coll) {
    let comm = &ranks.comms[0];
    let (rank, n) = (comm.rank(), ranks.size);
    let stream = comm.stream();
    let one: CudaSlice<T> = stream.alloc_zeros(1).unwrap();
    let mut one_out: CudaSlice<T> = stream.alloc_zeros(1).unwrap();
    let all: CudaSlice<T> = stream.alloc_zeros(n).unwrap();
    let mut all_out: CudaSlice<T> = stream.alloc_zeros(n).unwrap();
    // Shapes that would be valid, with this rank as the root.
    let call = match coll {
        Coll::AllToAll => Operation::all_to_all(&all, &mut all_out),
        Coll::Gather => Operation::gather(&one, Some(&mut all_out), rank),
        Coll::Scatter => Operation::scatter(Some(&all), &mut one_out, rank),
        _ => panic!("{coll:?} is in every NCCL 2"),
    };
    match comm.enqueue(call) {
        Err(nccl::Error::Unsupported { needs, .. }) => assert_eq!(needs, coll.since(), "{coll:?}"),
        other => panic!(
            "rank {rank}: {coll:?} {:?} on NCCL {}: {other:?}, want Error::Unsupported",
            T::DATA_TYPE,
            comm.library().version()
        ),
    }
}

/// Every collective x in/out of place x every reduction for one element type. A collective
/// the loaded NCCL lacks is checked to be refused instead (`Coll::since`).
pub fn run_type<T: Elem>(ranks: &Ranks, count: usize, seed: u64) -> usize {
    let version = ranks.comms[0].library().version();
    let mut checked = 0;
    for (ci, coll) in Coll::ALL.into_iter().enumerate() {
        if version < coll.since() {
            assert_refused::<T>(ranks, coll);
            continue;
        }
        let ops: Vec<Option<Op>> = if coll.reduces() {
            Op::all::<T>().into_iter().map(Some).collect()
        } else {
            vec![None]
        };
        for (oi, op) in ops.into_iter().enumerate() {
            for in_place in [false, true] {
                if in_place && !coll.has_in_place() {
                    continue;
                }
                let case_seed = seed.wrapping_add((ci * 100 + oi * 10 + in_place as usize) as u64);
                checked += run_case::<T>(ranks, coll, op, in_place, count, case_seed);
            }
        }
    }
    checked
}

/// The whole matrix over all twelve element types. Returns checked buffers.
pub fn run_all_types(ranks: &Ranks, count: usize) -> usize {
    let mut checked = 0;
    checked += run_type::<i8>(ranks, count, 1);
    checked += run_type::<u8>(ranks, count, 2);
    checked += run_type::<i32>(ranks, count, 3);
    checked += run_type::<u32>(ranks, count, 4);
    checked += run_type::<i64>(ranks, count, 5);
    checked += run_type::<u64>(ranks, count, 6);
    checked += run_type::<half::f16>(ranks, count, 7);
    checked += run_type::<f32>(ranks, count, 8);
    checked += run_type::<f64>(ranks, count, 9);
    checked += run_type::<half::bf16>(ranks, count, 10);
    checked += run_type::<float8::F8E4M3>(ranks, count, 11);
    checked += run_type::<float8::F8E5M2>(ranks, count, 12);
    checked
}
