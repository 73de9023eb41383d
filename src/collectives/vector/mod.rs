//! Variable-count collectives ("v-collectives"): [`all_to_all_v`](VOperation::all_to_all_v),
//! [`all_gather_v`](VOperation::all_gather_v), [`reduce_scatter_v`](VOperation::reduce_scatter_v),
//! [`gather_v`](VOperation::gather_v) and [`scatter_v`](VOperation::scatter_v): what
//! mixture-of-experts dispatch, ragged batches and uneven shards run on.
//!
//! NCCL has no variable-count collectives; they are built, as every framework builds them,
//! from NCCL calls in one group. The rooms: `layout.rs` ([`Layout`]: where each rank's
//! segment lies), `operation.rs` ([`VOperation`] and its constructors), `rules.rs` (the
//! checks) and `plan.rs` (the expansion into NCCL calls), both pure functions, `dispatch.rs`
//! (the path to NCCL) and `checked.rs` (what crosses ranks: the checked mode and
//! [`Comm::exchange_counts`](crate::Comm::exchange_counts)).
//!
//! # Using them
//!
//! Alone, a `Comm` method runs one on the communicator's stream ([`Comm::all_to_all_v`](crate::Comm::all_to_all_v), ...,
//! or [`Comm::enqueue_v_on`](crate::Comm::enqueue_v_on) for another stream of its context); in a [`Group`](crate::Group)
//! (several GPUs driven from one thread, or fused with other operations),
//! [`Group::enqueue_v`](crate::Group::enqueue_v) takes the same [`VOperation`]. Blocking and
//! nonblocking communicators both work. Counts and displacements are in elements;
//! displacements are optional ([`Layout::packed`], which plain count vectors convert into).
//!
//! # Constructions, and why
//!
//! * all-to-all-v, gather-v, scatter-v: grouped `ncclSend`/`ncclRecv`, one pair per pair of
//!   ranks with data. This is NCCL's own recipe for all-to-all and (scatter/gather) what
//!   torch's `all_to_all_single` with splits runs; NCCL schedules the grouped transfers over
//!   all its channels. A rank's segment for itself is a send and receive to itself in the
//!   same group (NCCL copies it locally; a `cudaMemcpyAsync` would be the alternative the
//!   GPU bench can compare).
//! * all-gather-v: grouped `ncclSend`/`ncclRecv` by default ([`Construction::Auto`]),
//!   one `ncclBroadcast` per root on request ([`Construction::Collective`]). Measured on
//!   2 x H200 over NVLink (NCCL 2.28.9, `bench all_gather_v --construction ...`, 1 MiB to
//!   512 MiB): with even splits send/receive took 15.0 ... 906 us against 15.3 ... 1061 us
//!   for the broadcasts (and 15.7 ... 1046 us for the fixed-size `ncclAllGather`), with
//!   Zipf(1.1) splits 14.3 ... 2028 us against 16.8 ... 2530 us. The broadcasts remain for
//!   machines where a root's links are the bottleneck (several nodes: each broadcast is a
//!   pipelined ring, so a large segment leaves its root once, not `size - 1` times), which
//!   this machine could not measure.
//! * reduce-scatter-v: one `ncclReduce` per root with its segment, grouped: reductions need
//!   NCCL's reduction kernels, which point-to-point calls do not have. Against the fixed-size
//!   `ncclReduceScatter` (even splits, same run) it was 0.68-0.83x from 2 to 16 MiB and
//!   1.18-1.32x from 64 MiB up.
//!
//! The bench (`examples/bench --construction`) re-measures the choice on other machines.
//!
//! Transfers of zero elements are not issued at all (NCCL allows count 0, but a skipped call
//! costs nothing): when the ranks' counts agree, both sides of a pair skip together.
//!
//! # What is checked
//!
//! Before anything is enqueued, on every rank: each layout has one count and one
//! displacement per rank; every segment lies inside its buffer (its end computed without
//! overflow, so every count and byte offset fits NCCL's `size_t`); segments that are written
//! do not overlap (overlapping writes would corrupt each other silently); a rank's own
//! contribution matches its own segment; root-only buffers and layouts are there on the
//! root; the root is a rank; and everything an ordinary operation checks (library version,
//! element type, streams and buffers in the communicator's context, a
//! [`PreMulSum`](crate::PreMulSum) created on this communicator). A rejected call is an
//! [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming the rank and segment, and
//! nothing is enqueued.
//!
//! What no rank can check alone is that the ranks agree: that rank `i`'s send count for
//! rank `j` equals rank `j`'s receive count for rank `i` (and that all ranks run the same
//! v-collective with the same root and construction). When they disagree NCCL transfers
//! the wrong amounts, which corrupts data or hangs. [`VOperation::checked`] verifies it with
//! one extra exchange and returns [`Error::CountMismatch`](crate::Error::CountMismatch),
//! naming the first mismatching pair, on every rank.
//!
//! ```no_run
//! # fn two_ranks(comm: &nccl::Comm) -> nccl::Result<()> {
//! use nccl::{Layout, VOperation};
//! let stream = comm.stream();
//! // Rank r sends r + 1 elements to every rank (2 ranks).
//! let mine = vec![1.0f32; comm.rank() + 1];
//! let send = stream.clone_htod(&[mine.clone(), mine].concat())?;
//! let recv_counts = vec![1, 2];
//! let mut recv = stream.alloc_zeros::<f32>(3)?;
//! let send_counts = vec![comm.rank() + 1; 2];
//! comm.enqueue_v(
//!     VOperation::all_to_all_v(&send, send_counts, &mut recv, Layout::packed(recv_counts))
//!         .checked(),
//! )?;
//! # Ok(())
//! # }
//! ```

mod checked;
mod dispatch;
mod layout;
mod operation;
mod plan;
mod rules;

pub(crate) use checked::verify;
pub(crate) use dispatch::dispatch_v;
pub use layout::Layout;
pub use operation::{VOperation, DEFAULT_CHECK_TIMEOUT};
pub use rules::Construction;
