//! Point-to-point communication (`ncclSend` / `ncclRecv`, NCCL 2.7).
//!
//! A send to rank `peer` must be matched by a receive from this rank on `peer`, with the same
//! element type and count. Both block the GPU until the transfer happens, so sends and
//! receives that depend on each other (a ring exchange, a send to oneself) must be issued in
//! one [`Group`](crate::Group): outside a group, a rank whose send waits for a receive that
//! its peer has not posted yet would hang.
//!
//! ```no_run
//! # fn ring(comm: &nccl::Comm, send: &cudarc::driver::CudaSlice<f32>,
//! #         recv: &mut cudarc::driver::CudaSlice<f32>) -> nccl::Result<()> {
//! use nccl::{Group, Operation};
//! let next = (comm.rank() + 1) % comm.size();
//! let prev = (comm.rank() + comm.size() - 1) % comm.size();
//! let mut group = Group::start()?;
//! group.enqueue(comm, Operation::send(send, next))?;
//! group.enqueue(comm, Operation::recv(recv, prev))?;
//! group.finish()
//! # }
//! ```
//!
//! [`Operation::send`](crate::Operation::send) and [`Operation::recv`](crate::Operation::recv)
//! describe them, and [`Comm::send`](crate::Comm::send) and [`Comm::recv`](crate::Comm::recv)
//! enqueue them alone; both are written, with the collectives, from the table in
//! `collectives/operation.rs`.
