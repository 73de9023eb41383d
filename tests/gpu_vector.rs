//! The v-collectives on every visible GPU (N >= 2), against host references on random data:
//! every v-collective x f32, i32, bf16 x (even, skewed, zero for some ranks, all zero) x in
//! and out of place, both all-gather constructions, every reduction of reduce-scatter; the
//! count exchange; the checked mode catching a mismatch on every rank; nonblocking
//! communicators.
//!
//! Past 600 lines on purpose: each case keeps its expected result next to the call that
//! produces it, which is what a reader checks.
//!
//! Run on a GPU host with `cargo test --test gpu_vector -- --include-ignored`.

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use nccl::{
    Comm, CommConfig, Construction, Error, Group, Layout, PreMulSum, ReduceOp, Reduction, UniqueId,
    VOperation,
};

use common::{assert_close, input, reduce_ref, to_f64, Elem, Op, Ranks, Rng};

/// One communicator per rank from `Comm::init_all`: every visible GPU, or GPU 0 twice on a
/// one-GPU host (NCCL 2.30+); `None` (the test is skipped, saying why) where neither works.
fn all_gpus(test: &str) -> Option<Ranks> {
    let layout = common::shape::threaded(test)?;
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    Some(Ranks {
        comms,
        size: layout.size(),
    })
}

/// Marks elements no rank should write.
const UNTOUCHED: f64 = 123.0;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Even,
    Skewed,
    SomeZero,
    AllZero,
}

const SHAPES: [Shape; 4] = [Shape::Even, Shape::Skewed, Shape::SomeZero, Shape::AllZero];

/// `m[i][j]`: what rank `i` sends to rank `j`.
fn matrix(shape: Shape, n: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| match shape {
                    Shape::Even => 257,
                    // One heavy pair, the rest uneven: the MoE hot-expert pattern.
                    Shape::Skewed if (i, j) == (0, n - 1) => 40_000,
                    Shape::Skewed => rng.range(1, 900) as usize,
                    // Rank 0 sends nothing and the last rank receives nothing.
                    Shape::SomeZero if i == 0 || j == n - 1 => 0,
                    Shape::SomeZero => rng.range(1, 300) as usize,
                    Shape::AllZero => 0,
                })
                .collect()
        })
        .collect()
}

/// `counts` laid out in reverse rank order with a one-element gap before each segment (odd
/// seeds), or packed (even seeds): both layouts kinds, the buffer length they need.
fn layout(counts: &[usize], seed: u64) -> (Layout, usize) {
    if seed.is_multiple_of(2) {
        let layout = Layout::packed(counts.to_vec());
        let len = layout.total();
        return (layout, len);
    }
    let mut displs = vec![0; counts.len()];
    let mut at = 0;
    for i in (0..counts.len()).rev() {
        at += 1;
        displs[i] = at;
        at += counts[i];
    }
    (Layout::with_displacements(counts.to_vec(), displs), at)
}

/// A device buffer of exactly `len` elements (CUDA allocates no zero-byte buffers: one
/// spare element backs empty ones), viewed through `view`/`view_mut`.
struct Dev<T: Elem> {
    slice: CudaSlice<T>,
    len: usize,
}

impl<T: Elem> Dev<T> {
    fn new(stream: &Arc<CudaStream>, host: &[T]) -> Self {
        let mut data = host.to_vec();
        if data.is_empty() {
            data.push(T::from_f64(UNTOUCHED));
        }
        Self {
            slice: stream.clone_htod(&data).expect("htod"),
            len: host.len(),
        }
    }
    fn untouched(stream: &Arc<CudaStream>, len: usize) -> Self {
        Self::new(stream, &vec![T::from_f64(UNTOUCHED); len])
    }
    fn view(&self) -> CudaView<'_, T> {
        self.slice.slice(..self.len)
    }
    fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(..self.len)
    }
    fn host(&self) -> Vec<f64> {
        let all = self.slice.stream().clone_dtoh(&self.slice).expect("dtoh");
        to_f64(&all[..self.len])
    }
}

fn seg(layout: &Layout, i: usize) -> std::ops::Range<usize> {
    layout.segment(i).unwrap()
}

fn untouched(len: usize) -> Vec<f64> {
    vec![UNTOUCHED; len]
}

fn all_to_all_case<T: Elem>(ranks: &Ranks, shape: Shape, seed: u64) -> usize {
    let n = ranks.size;
    let m = matrix(shape, n, seed);
    let data: Vec<Vec<T>> = (0..n)
        .map(|i| input(None, seed * 31 + i as u64, m[i].iter().sum()))
        .collect();
    let send_layouts: Vec<_> = (0..n).map(|i| layout(&m[i], seed)).collect();
    let recv_layouts: Vec<_> = (0..n)
        .map(|j| layout(&(0..n).map(|i| m[i][j]).collect::<Vec<_>>(), seed + 1))
        .collect();
    // The send buffer in its layout (gaps hold untouched values).
    let sends: Vec<Dev<T>> = (0..n)
        .map(|i| {
            let (l, len) = &send_layouts[i];
            let mut host = vec![T::from_f64(UNTOUCHED); *len];
            let mut at = 0;
            for j in 0..n {
                host[seg(l, j)].copy_from_slice(&data[i][at..at + m[i][j]]);
                at += m[i][j];
            }
            Dev::new(ranks.stream(i), &host)
        })
        .collect();
    let mut recvs: Vec<Dev<T>> = (0..n)
        .map(|j| Dev::untouched(ranks.stream(j), recv_layouts[j].1))
        .collect();
    {
        let send_views: Vec<_> = sends.iter().map(Dev::view).collect();
        let mut recv_views: Vec<_> = recvs.iter_mut().map(Dev::view_mut).collect();
        let mut group = Group::start().unwrap();
        for (i, (send, recv)) in send_views.iter().zip(recv_views.iter_mut()).enumerate() {
            let call = VOperation::all_to_all_v(
                send,
                send_layouts[i].0.clone(),
                recv,
                recv_layouts[i].0.clone(),
            );
            group.enqueue_v(&ranks.comms[i], call).unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    for j in 0..n {
        let (l, len) = &recv_layouts[j];
        let mut want = untouched(*len);
        for i in 0..n {
            let from = send_layouts[i].0.segment(j).unwrap();
            let host_send = sends[i].host();
            want[seg(l, i)].copy_from_slice(&host_send[from]);
        }
        assert_close(
            &format!("all_to_all_v {:?} {shape:?} rank {j}", T::DATA_TYPE),
            &recvs[j]
                .host()
                .iter()
                .map(|&v| T::from_f64(v))
                .collect::<Vec<T>>(),
            &want,
        );
    }
    n
}

fn all_gather_case<T: Elem>(
    ranks: &Ranks,
    shape: Shape,
    construction: Construction,
    in_place: bool,
    seed: u64,
) -> usize {
    let n = ranks.size;
    let counts: Vec<usize> = matrix(shape, n, seed)
        .into_iter()
        .map(|row| row[0])
        .collect();
    let data: Vec<Vec<T>> = (0..n)
        .map(|i| input(None, seed * 37 + i as u64, counts[i]))
        .collect();
    // Each rank may place the segments differently.
    let layouts: Vec<_> = (0..n).map(|i| layout(&counts, seed + i as u64)).collect();
    let sends: Vec<Dev<T>> = (0..n)
        .map(|i| Dev::new(ranks.stream(i), &data[i]))
        .collect();
    let mut recvs: Vec<Dev<T>> = (0..n)
        .map(|i| {
            let (l, len) = &layouts[i];
            let mut host = vec![T::from_f64(UNTOUCHED); *len];
            if in_place {
                host[seg(l, i)].copy_from_slice(&data[i]);
            }
            Dev::new(ranks.stream(i), &host)
        })
        .collect();
    {
        let send_views: Vec<_> = sends.iter().map(Dev::view).collect();
        let mut recv_views: Vec<_> = recvs.iter_mut().map(Dev::view_mut).collect();
        let mut group = Group::start().unwrap();
        for (i, recv) in recv_views.iter_mut().enumerate() {
            let l = layouts[i].0.clone();
            let call = if in_place {
                VOperation::all_gather_v_in_place(recv, l)
            } else {
                VOperation::all_gather_v(&send_views[i], recv, l)
            };
            group
                .enqueue_v(&ranks.comms[i], call.construction(construction))
                .unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    for i in 0..n {
        let (l, len) = &layouts[i];
        let mut want = untouched(*len);
        for j in 0..n {
            want[seg(l, j)].copy_from_slice(&to_f64(&data[j]));
        }
        let label = format!(
            "all_gather_v {:?} {shape:?} {construction:?} in_place={in_place} rank {i}",
            T::DATA_TYPE
        );
        check::<T>(&label, &recvs[i].host(), &want);
    }
    n
}

fn check<T: Elem>(label: &str, got: &[f64], want: &[f64]) {
    let got: Vec<T> = got.iter().map(|&v| T::from_f64(v)).collect();
    assert_close(label, &got, want);
}

fn reduce_scatter_case<T: Elem>(
    ranks: &Ranks,
    shape: Shape,
    op: Op,
    in_place: bool,
    seed: u64,
) -> usize {
    let n = ranks.size;
    let counts: Vec<usize> = matrix(shape, n, seed)
        .into_iter()
        .map(|row| row[0])
        .collect();
    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|i| input(Some(op), seed * 41 + i as u64, total))
        .collect();
    let layouts: Vec<_> = (0..n).map(|i| layout(&counts, seed + i as u64)).collect();
    // Each rank's input in its own layout.
    let placed: Vec<Vec<T>> = (0..n)
        .map(|i| {
            let (l, len) = &layouts[i];
            let mut host = vec![T::from_f64(UNTOUCHED); *len];
            let mut at = 0;
            for j in 0..n {
                host[seg(l, j)].copy_from_slice(&inputs[i][at..at + counts[j]]);
                at += counts[j];
            }
            host
        })
        .collect();
    let pre_mul: Vec<Option<PreMulSum<'_, T>>> = ranks
        .comms
        .iter()
        .map(|comm| match op {
            Op::PreMulSum(s) => Some(PreMulSum::with_host_scalar(comm, T::from_f64(s)).unwrap()),
            Op::Builtin(_) => None,
        })
        .collect();
    let reduction = |i: usize| -> Reduction<'_, T> {
        match (op, &pre_mul[i]) {
            (Op::Builtin(op), _) => op.into(),
            (Op::PreMulSum(_), Some(p)) => p.into(),
            (Op::PreMulSum(_), None) => unreachable!(),
        }
    };
    let sends: Vec<Dev<T>> = (0..n)
        .map(|i| Dev::new(ranks.stream(i), &placed[i]))
        .collect();
    let mut outs: Vec<Dev<T>> = (0..n)
        .map(|i| {
            if in_place {
                Dev::new(ranks.stream(i), &placed[i])
            } else {
                Dev::untouched(ranks.stream(i), counts[i])
            }
        })
        .collect();
    {
        let send_views: Vec<_> = sends.iter().map(Dev::view).collect();
        let mut out_views: Vec<_> = outs.iter_mut().map(Dev::view_mut).collect();
        let mut group = Group::start().unwrap();
        for (i, out) in out_views.iter_mut().enumerate() {
            let l = layouts[i].0.clone();
            let call = if in_place {
                VOperation::reduce_scatter_v_in_place(out, l, reduction(i))
            } else {
                VOperation::reduce_scatter_v(&send_views[i], l, out, reduction(i))
            };
            group.enqueue_v(&ranks.comms[i], call).unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    let mut at = 0;
    for i in 0..n {
        let segments: Vec<Vec<T>> = inputs
            .iter()
            .map(|v| v[at..at + counts[i]].to_vec())
            .collect();
        at += counts[i];
        let reduced = if counts[i] == 0 {
            Vec::new()
        } else {
            reduce_ref(op, &segments)
        };
        let want = if in_place {
            let mut want = to_f64(&placed[i]);
            want[seg(&layouts[i].0, i)].copy_from_slice(&reduced);
            want
        } else {
            reduced
        };
        let label = format!(
            "reduce_scatter_v {:?} {shape:?} {op:?} in_place={in_place} rank {i}",
            T::DATA_TYPE
        );
        check::<T>(&label, &outs[i].host(), &want);
    }
    n
}

fn gather_case<T: Elem>(ranks: &Ranks, shape: Shape, in_place: bool, seed: u64) -> usize {
    let n = ranks.size;
    let root = n - 1;
    let counts: Vec<usize> = matrix(shape, n, seed)
        .into_iter()
        .map(|row| row[root])
        .collect();
    let data: Vec<Vec<T>> = (0..n)
        .map(|i| input(None, seed * 43 + i as u64, counts[i]))
        .collect();
    let (l, len) = layout(&counts, seed);
    let sends: Vec<Dev<T>> = (0..n)
        .map(|i| Dev::new(ranks.stream(i), &data[i]))
        .collect();
    let mut recvs: Vec<Dev<T>> = (0..n)
        .map(|i| match (i == root, in_place) {
            (true, true) => {
                let mut host = vec![T::from_f64(UNTOUCHED); len];
                host[seg(&l, root)].copy_from_slice(&data[root]);
                Dev::new(ranks.stream(i), &host)
            }
            (true, false) => Dev::untouched(ranks.stream(i), len),
            (false, true) => Dev::new(ranks.stream(i), &data[i]),
            (false, false) => Dev::untouched(ranks.stream(i), 0),
        })
        .collect();
    {
        let send_views: Vec<_> = sends.iter().map(Dev::view).collect();
        let mut recv_views: Vec<_> = recvs.iter_mut().map(Dev::view_mut).collect();
        let mut group = Group::start().unwrap();
        for (i, recv) in recv_views.iter_mut().enumerate() {
            let mine = (i == root).then(|| l.clone());
            let call = match (in_place, i == root) {
                (true, _) => VOperation::gather_v_in_place(recv, mine, root),
                (false, true) => VOperation::gather_v(
                    &send_views[i],
                    Some(recv as &mut dyn DevicePtrMut<T>),
                    mine,
                    root,
                ),
                (false, false) => VOperation::gather_v(&send_views[i], None, None, root),
            };
            group.enqueue_v(&ranks.comms[i], call).unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    let mut want = untouched(len);
    for j in 0..n {
        want[seg(&l, j)].copy_from_slice(&to_f64(&data[j]));
    }
    let label = format!("gather_v {:?} {shape:?} in_place={in_place}", T::DATA_TYPE);
    check::<T>(&label, &recvs[root].host(), &want);
    for i in (0..n).filter(|&i| i != root && in_place) {
        check::<T>(
            &format!("{label} sender {i}"),
            &recvs[i].host(),
            &to_f64(&data[i]),
        );
    }
    1
}

fn scatter_case<T: Elem>(ranks: &Ranks, shape: Shape, in_place: bool, seed: u64) -> usize {
    let n = ranks.size;
    let root = 0;
    // Column 0: with some zero, the root keeps nothing and the others get data.
    let counts: Vec<usize> = matrix(shape, n, seed)
        .into_iter()
        .map(|row| row[0])
        .collect();
    let (l, len) = layout(&counts, seed);
    let source: Vec<T> = input(None, seed * 47, len);
    let sends: Vec<Dev<T>> = (0..n)
        .map(|i| Dev::new(ranks.stream(i), if i == root { &source } else { &[] }))
        .collect();
    let mut recvs: Vec<Dev<T>> = (0..n)
        .map(|i| {
            if i == root && in_place {
                Dev::new(ranks.stream(i), &source)
            } else {
                Dev::untouched(ranks.stream(i), counts[i])
            }
        })
        .collect();
    {
        let send_views: Vec<_> = sends.iter().map(Dev::view).collect();
        let mut recv_views: Vec<_> = recvs.iter_mut().map(Dev::view_mut).collect();
        let mut group = Group::start().unwrap();
        for (i, recv) in recv_views.iter_mut().enumerate() {
            let mine = (i == root).then(|| l.clone());
            let call = if in_place {
                VOperation::scatter_v_in_place(recv, mine, root)
            } else {
                let send = (i == root).then_some(&send_views[i] as &dyn DevicePtr<T>);
                VOperation::scatter_v(send, mine, recv, root)
            };
            group.enqueue_v(&ranks.comms[i], call).unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    let source = to_f64(&source);
    for i in 0..n {
        let want = if i == root && in_place {
            source.clone()
        } else {
            source[seg(&l, i)].to_vec()
        };
        let label = format!(
            "scatter_v {:?} {shape:?} in_place={in_place} rank {i}",
            T::DATA_TYPE
        );
        check::<T>(&label, &recvs[i].host(), &want);
    }
    n
}

fn every_case<T: Elem>(ranks: &Ranks) -> usize {
    let mut checked = 0;
    for (k, shape) in SHAPES.into_iter().enumerate() {
        for seed in [2 * k as u64 + 10, 2 * k as u64 + 11] {
            checked += all_to_all_case::<T>(ranks, shape, seed);
            for in_place in [false, true] {
                for construction in [Construction::Collective, Construction::PointToPoint] {
                    checked += all_gather_case::<T>(ranks, shape, construction, in_place, seed);
                }
                for op in Op::all::<T>() {
                    checked += reduce_scatter_case::<T>(ranks, shape, op, in_place, seed);
                }
                checked += gather_case::<T>(ranks, shape, in_place, seed);
                checked += scatter_case::<T>(ranks, shape, in_place, seed);
            }
        }
    }
    checked
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_v_collective_type_and_shape_single_process() {
    let Some(ranks) = all_gpus("every_v_collective_type_and_shape_single_process") else {
        return;
    };
    let checked =
        every_case::<f32>(&ranks) + every_case::<i32>(&ranks) + every_case::<half::bf16>(&ranks);
    println!(
        "{} ranks: {checked} v-collective buffers checked",
        ranks.size
    );
    assert!(checked > 300, "only {checked} buffers checked");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn invalid_v_calls_are_rejected_before_nccl_and_leave_the_group_usable() {
    let Some(ranks) = all_gpus("invalid_v_calls_are_rejected_before_nccl") else {
        return;
    };
    let n = ranks.size;
    let stream = ranks.stream(0);
    let send: CudaSlice<f32> = stream.clone_htod(&vec![1.0f32; 4 * n]).unwrap();
    // A group keeps what it was given borrowed until it ends: one buffer per attempt.
    let mut recvs: Vec<CudaSlice<f32>> =
        (0..3).map(|_| stream.alloc_zeros(4 * n).unwrap()).collect();
    let [recv_a, recv_b, recv_c] = &mut recvs[..] else {
        unreachable!()
    };
    let mut group = Group::start().unwrap();
    // A receive segment past the end of the buffer.
    let mut too_far = vec![4; n];
    too_far[n - 1] = 5;
    let err = group
        .enqueue_v(
            &ranks.comms[0],
            VOperation::all_to_all_v(&send, vec![4; n], recv_a, too_far),
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("segment for rank {}", n - 1)),
        "{err}"
    );
    // Overlapping receive segments.
    let overlapping = Layout::with_displacements(vec![4; n], vec![0; n]);
    let err = group
        .enqueue_v(
            &ranks.comms[0],
            VOperation::all_to_all_v(&send, vec![4; n], recv_b, overlapping),
        )
        .unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    // The checked mode cannot run inside a group.
    let err = group
        .enqueue_v(
            &ranks.comms[0],
            VOperation::all_to_all_v(&send, vec![4; n], recv_c, vec![4; n]).checked(),
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
    assert_eq!(group.buffer_count(), 0, "nothing was enqueued");
    group.finish().unwrap();
    // The communicators still work.
    assert_eq!(all_to_all_case::<f32>(&ranks, Shape::Even, 0), n);
}

/// One thread per rank, each with its own communicator (`init_rank`): what synchronising
/// calls (the checked mode, the count exchange) need when one process drives every GPU.
fn per_thread<R: Send + 'static>(
    test: &str,
    config: CommConfig,
    body: impl Fn(Comm) -> R + Send + Sync + 'static,
) -> Option<Vec<R>> {
    let devices = common::shape::threaded(test)?.devices;
    let n = devices.len();
    let id = UniqueId::new().unwrap();
    let body = Arc::new(body);
    let (tx, rx) = mpsc::channel();
    for (rank, &device) in devices.iter().enumerate() {
        let (tx, body, id, config) = (tx.clone(), body.clone(), id, config.clone());
        std::thread::spawn(move || {
            let stream = CudaContext::new(device).unwrap().new_stream().unwrap();
            let comm = Comm::init_rank_with_config(stream, &id, rank, n, &config).unwrap();
            let _ = tx.send((rank, body(comm)));
        });
    }
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        // Bounded: a hang is a failure, not a stuck test run.
        let (rank, result) = rx
            .recv_timeout(Duration::from_secs(180))
            .expect("every rank finishes within 3 minutes");
        results[rank] = Some(result);
    }
    Some(results.into_iter().map(Option::unwrap).collect())
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn exchange_counts_gives_the_receive_layout_and_all_to_all_v_uses_it() {
    let Some(results) = per_thread(
        "exchange_counts_gives_the_receive_layout",
        CommConfig::new(),
        |comm| {
            let (rank, n) = (comm.rank(), comm.size());
            // Rank r sends (r + 1) * (j + 1) elements to rank j, valued 1000 r + j.
            let send_counts: Vec<usize> = (0..n).map(|j| (rank + 1) * (j + 1)).collect();
            let recv_layout = comm.exchange_counts(&send_counts).unwrap();
            let want: Vec<usize> = (0..n).map(|i| (i + 1) * (rank + 1)).collect();
            assert_eq!(recv_layout.counts(), &want[..]);
            let host: Vec<f32> = (0..n)
                .flat_map(|j| vec![(1000 * rank + j) as f32; send_counts[j]])
                .collect();
            let send = comm.stream().clone_htod(&host).unwrap();
            let mut recv = comm
                .stream()
                .alloc_zeros::<f32>(recv_layout.total())
                .unwrap();
            comm.all_to_all_v(&send, send_counts, &mut recv, recv_layout.clone())
                .unwrap();
            comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
            let got = comm.stream().clone_dtoh(&recv).unwrap();
            for i in 0..n {
                let segment = &got[recv_layout.segment(i).unwrap()];
                assert!(
                    segment.iter().all(|&v| v == (1000 * i + rank) as f32),
                    "from {i}"
                );
            }
            rank
        },
    ) else {
        return;
    };
    assert_eq!(results, (0..results.len()).collect::<Vec<_>>());
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn checked_mode_reports_a_mismatch_on_every_rank_and_enqueues_nothing() {
    let Some(results) = per_thread(
        "checked_mode_reports_a_mismatch",
        CommConfig::new(),
        |comm| {
            let (rank, n) = (comm.rank(), comm.size());
            let stream = comm.stream().clone();
            let send = stream.clone_htod(&vec![1.0f32; 8 * n]).unwrap();
            let mut recv = stream.alloc_zeros::<f32>(8 * n).unwrap();
            // Everyone sends 8 to everyone, but the last rank expects 7 from rank 0.
            let mut expect = vec![8; n];
            if rank == n - 1 {
                expect[0] = 7;
            }
            let call = VOperation::all_to_all_v(&send, vec![8; n], &mut recv, expect)
                .checked_within(Duration::from_secs(60));
            let first = comm.enqueue_v(call).unwrap_err();
            // Agreeing counts then pass the check, and the data moves.
            let call = VOperation::all_to_all_v(&send, vec![8; n], &mut recv, vec![8; n]).checked();
            comm.enqueue_v(call).unwrap();
            comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
            let moved = stream.clone_dtoh(&recv).unwrap();
            assert!(moved.iter().all(|&v| v == 1.0));
            // A rank with invalid arguments is reported to all, nobody waits for it.
            let send_counts = if rank == 0 {
                vec![8; n + 1]
            } else {
                vec![8; n]
            };
            let call =
                VOperation::all_to_all_v(&send, send_counts, &mut recv, vec![8; n]).checked();
            let invalid = comm.enqueue_v(call).unwrap_err();
            // So is a rank whose buffer only the enqueue itself would refuse (it lives in
            // another device's context): it takes part in the exchange instead of failing
            // alone after it while the others enqueue.
            // (Only where there is another GPU: ranks sharing one have no foreign device.)
            let other_gpu = nccl::library::cuda_device_count().unwrap() > 1;
            let refused = other_gpu.then(|| {
                let mut foreign = if rank == 0 {
                    let other = CudaContext::new(1).unwrap().new_stream().unwrap();
                    other.alloc_zeros::<f32>(8 * n).unwrap()
                } else {
                    stream.alloc_zeros::<f32>(8 * n).unwrap()
                };
                let call =
                    VOperation::all_to_all_v(&send, vec![8; n], &mut foreign, vec![8; n]).checked();
                comm.enqueue_v(call).unwrap_err()
            });
            (first, invalid, refused)
        },
    ) else {
        return;
    };
    let n = results.len();
    for (rank, (first, invalid, refused)) in results.iter().enumerate() {
        match first {
            Error::CountMismatch {
                call,
                sender,
                receiver,
                sent,
                expected,
            } => assert_eq!(
                (*call, *sender, *receiver, *sent, *expected),
                ("all_to_all_v", 0, n - 1, 8, 7),
                "rank {rank}"
            ),
            other => panic!("rank {rank}: expected a count mismatch, got {other}"),
        }
        assert!(
            matches!(invalid, Error::InvalidArgument(_)),
            "rank {rank}: {invalid}"
        );
        let text = invalid.to_string();
        if rank == 0 {
            assert!(text.contains("send layout has"), "{text}");
        } else {
            assert!(text.contains("rank 0 rejected its own arguments"), "{text}");
        }
        let Some(refused) = refused else {
            println!("rank {rank}: one GPU, so no foreign-device case");
            continue;
        };
        let text = refused.to_string();
        if rank == 0 {
            assert!(text.contains("the receive buffer is on device 1"), "{text}");
        } else {
            assert!(text.contains("rank 0 rejected its own arguments"), "{text}");
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn nonblocking_communicators_run_v_collectives() {
    let config = CommConfig::new()
        .blocking(false)
        .ready_timeout(Duration::from_secs(120));
    let Some(results) = per_thread(
        "nonblocking_communicators_run_v_collectives",
        config,
        |comm| {
            assert!(!comm.is_blocking());
            let (rank, n) = (comm.rank(), comm.size());
            let stream = comm.stream().clone();
            // all_gather_v: rank r contributes r + 1 copies of r.
            let counts: Vec<usize> = (1..=n).collect();
            let mine = stream.clone_htod(&vec![rank as i32; rank + 1]).unwrap();
            let layout = Layout::packed(counts.clone());
            let mut all = stream.alloc_zeros::<i32>(layout.total()).unwrap();
            comm.all_gather_v(&mine, &mut all, layout.clone()).unwrap();
            // reduce_scatter_v of ones: every segment sums to n.
            let ones = stream.clone_htod(&vec![1i32; layout.total()]).unwrap();
            let mut sum = stream.alloc_zeros::<i32>(rank + 1).unwrap();
            comm.reduce_scatter_v(&ones, layout.clone(), &mut sum, ReduceOp::Sum)
                .unwrap();
            comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
            let all = stream.clone_dtoh(&all).unwrap();
            for i in 0..n {
                assert!(all[layout.segment(i).unwrap()]
                    .iter()
                    .all(|&v| v == i as i32));
            }
            let sum = stream.clone_dtoh(&sum).unwrap();
            assert!(sum.iter().all(|&v| v == n as i32), "{sum:?}");
            rank
        },
    ) else {
        return;
    };
    assert_eq!(results.len(), results.iter().max().unwrap() + 1);
}

/// M3: a checked v-collective whose count exchange times out (only rank 0 calls it) leaves
/// the exchange's all-gather queued on the stream; a late rank would pair with it. The
/// communicator must be aborted (before the fix the timeout came back and the communicator
/// stayed usable). First a checked all-to-all-v that every rank makes moves real data,
/// checked against the host reference.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m3_timed_out_checked_exchange_aborts_the_communicator() {
    const TEST: &str = "m3_timed_out_checked_exchange_aborts_the_communicator";
    let Some(_deadline) = common::threaded::gpu_test(TEST, Duration::from_secs(240)) else {
        return;
    };
    let devices = common::threaded::devices();
    let n = devices.len();
    let id = UniqueId::new().unwrap();
    let rank0_done = std::sync::Barrier::new(n);
    let c = 16;
    // Rank q sends block j (c elements) to rank j: values q * 1000 + j * 100 + i.
    let value = |q: usize, j: usize, i: usize| (q * 1000 + j * 100 + i) as f32;
    std::thread::scope(|scope| {
        for rank in 0..n {
            let (id, rank0_done, devices) = (&id, &rank0_done, &devices);
            scope.spawn(move || {
                let stream = CudaContext::new(devices[rank])
                    .unwrap()
                    .new_stream()
                    .unwrap();
                let comm =
                    Comm::init_rank_with_config(stream.clone(), id, rank, n, &CommConfig::new())
                        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                let mine: Vec<f32> = (0..n * c).map(|k| value(rank, k / c, k % c)).collect();
                let send = stream.clone_htod(&mine).unwrap();
                let mut recv = stream.alloc_zeros::<f32>(n * c).unwrap();
                let call = VOperation::all_to_all_v(&send, vec![c; n], &mut recv, vec![c; n])
                    .checked_within(Duration::from_secs(60));
                comm.enqueue_v(call).unwrap();
                comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
                let want: Vec<f32> = (0..n * c).map(|k| value(k / c, rank, k % c)).collect();
                assert_eq!(stream.clone_dtoh(&recv).unwrap(), want, "rank {rank}");
                if rank == 0 {
                    let call = VOperation::all_to_all_v(&send, vec![c; n], &mut recv, vec![c; n])
                        .checked_within(Duration::from_secs(3));
                    let err = comm
                        .enqueue_v(call)
                        .expect_err("no peer joins the exchange");
                    println!("rank 0: lone checked all_to_all_v: {err}");
                    assert!(matches!(err, Error::Timeout { .. }), "{err}");
                    assert!(err.to_string().contains("aborted"), "{err}");
                    let failure = comm.failure().expect("a failure is recorded");
                    assert!(failure.to_string().contains("aborted"), "{failure}");
                    drop(comm);
                    rank0_done.wait();
                } else {
                    rank0_done.wait();
                    drop(comm);
                }
            });
        }
    });
    common::shape::ran(TEST, &format!("{n} ranks"));
}
