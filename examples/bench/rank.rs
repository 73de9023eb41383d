//! One rank's communicator and stream, with the synchronisation helpers every measurement
//! uses: waiting for the stream, barriers, and combining one number over all ranks.

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use nccl::{Comm, ReduceOp};

use crate::args::Average;
use crate::BenchResult;

/// This process's rank.
pub struct Rank {
    /// The communicator.
    pub comm: Comm,
    /// Its stream, on which everything runs.
    pub stream: Arc<CudaStream>,
    /// The CUDA device ordinal.
    pub device: usize,
    /// One `f64` for combining numbers over ranks and for barriers (outside timed regions).
    /// In a cell so that every helper takes `&self`: registered buffers and windows borrow
    /// the communicator for as long as the measurements that use them run.
    scratch: RefCell<CudaSlice<f64>>,
}

impl Rank {
    /// Wraps a communicator; `stream` must be its stream.
    pub fn new(comm: Comm, stream: Arc<CudaStream>, device: usize) -> BenchResult<Self> {
        let scratch = stream.alloc_zeros::<f64>(1)?;
        Ok(Rank {
            comm,
            stream,
            device,
            scratch: RefCell::new(scratch),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }

    /// Waits until the stream is idle, the way nccl-tests does: polling `cuStreamQuery` and
    /// yielding the CPU in between, with no sleep that could overshoot the end of a timed
    /// region. A failed peer surfaces as the communicator's asynchronous error.
    pub fn wait(&self) -> BenchResult<()> {
        // Also reports errors cudarc recorded where it could not return them.
        self.stream.context().bind_to_thread()?;
        let stream = self.stream.cu_stream();
        let mut polls: u64 = 0;
        loop {
            // SAFETY: `stream` is a live stream handle owned by `self.stream`, which outlives
            // this call; cuStreamQuery only reads its state.
            match unsafe { sys::cuStreamQuery(stream) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                error => return Err(cudarc::driver::DriverError(error).into()),
            }
            polls += 1;
            if polls.is_multiple_of(1024) {
                if let Some(err) = self.comm.async_error()? {
                    return Err(err.into());
                }
            }
            std::thread::yield_now();
        }
    }

    /// A barrier over all ranks: a one-element all-reduce, waited for.
    pub fn barrier(&self) -> BenchResult<()> {
        self.comm
            .all_reduce_in_place(&mut *self.scratch.borrow_mut(), ReduceOp::Sum)?;
        self.wait()
    }

    /// Combines `value` over all ranks with `how`; every rank gets the result.
    pub fn combine(&self, value: f64, how: Average) -> BenchResult<f64> {
        let combined = self.reduce(value, how)?;
        Ok(match how {
            Average::Mean => combined / self.size() as f64,
            _ => combined,
        })
    }

    /// The sum of `value` over all ranks.
    pub fn sum(&self, value: f64) -> BenchResult<f64> {
        // The mean's reduction is the plain sum.
        self.reduce(value, Average::Mean)
    }

    fn reduce(&self, value: f64, how: Average) -> BenchResult<f64> {
        let mut scratch = self.scratch.borrow_mut();
        let scratch = &mut *scratch;
        self.stream.memcpy_htod(&[value], scratch)?;
        match how {
            Average::Rank0 => self.comm.broadcast_in_place(scratch, 0)?,
            Average::Mean => self.comm.all_reduce_in_place(scratch, ReduceOp::Sum)?,
            Average::Min => self.comm.all_reduce_in_place(scratch, ReduceOp::Min)?,
            Average::Max => self.comm.all_reduce_in_place(scratch, ReduceOp::Max)?,
        }
        self.wait()?;
        Ok(self.stream.clone_dtoh(&*scratch)?[0])
    }

    /// Every rank's `line` (at most 255 bytes of it), on every rank, in rank order.
    pub fn gather_lines(&self, line: &str) -> BenchResult<Vec<String>> {
        const WIDTH: usize = 256;
        let mut bytes = [0u8; WIDTH];
        let text = line.as_bytes();
        let len = text.len().min(WIDTH - 1);
        bytes[..len].copy_from_slice(&text[..len]);
        let send = self.stream.clone_htod(&bytes)?;
        let mut recv = self.stream.alloc_zeros::<u8>(WIDTH * self.size())?;
        self.comm.all_gather(&send, &mut recv)?;
        self.wait()?;
        let all = self.stream.clone_dtoh(&recv)?;
        Ok(all
            .chunks(WIDTH)
            .map(|chunk| {
                let end = chunk.iter().position(|&b| b == 0).unwrap_or(chunk.len());
                String::from_utf8_lossy(&chunk[..end]).into_owned()
            })
            .collect())
    }
}
