//! The LSA all-reduce harness of `examples/device_allreduce.rs`, also run by
//! `tests/gpu_device.rs`: every rank of a set of communicators (driven by this one thread)
//! gets an input and an output symmetric window, a device communicator with one LSA barrier
//! per CTA, and the kernel of `kernel.cu` built at run time for its GPU. Each size is checked
//! exactly against a host reference (integer-valued floats: every summation order is exact)
//! for the device kernel and for `ncclAllReduce` on the same windows, then both are timed.

use std::error::Error;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use nccl::device::kernel::{DeviceModule, Toolchain};
use nccl::device::{DevComm, DevCommRequirements, DeviceAbi};
use nccl::properties::{GinConnection, GinType};
use nccl::{Comm, Group, NcclBuffer, Operation, ReduceOp, Window, WindowFlags};

pub type Res<T> = Result<T, Box<dyn Error>>;

/// The kernel's source and name.
pub const SOURCE: &str = include_str!("kernel.cu");
pub const KERNEL: &str = "lsa_allreduce_sum_f32";
/// The largest message, and so each window's size.
pub const MAX_BYTES: usize = 1 << 20;
/// At most this many CTAs per rank, each with its LSA barrier: small grids, so every rank's
/// CTAs are resident together even when ranks share a GPU.
pub const MAX_CTAS: u32 = 8;
pub const THREADS: u32 = 512;
const SYNC: Duration = Duration::from_secs(60);

/// Every message size checked: 8 B to 1 MiB, powers of two.
pub fn sizes() -> Vec<usize> {
    (3..=20).map(|shift| 1usize << shift).collect()
}

/// Rank `rank`'s input for a message of `count` floats: integers in [-512, 512].
pub fn input(rank: usize, count: usize, seed: u64) -> Vec<f32> {
    let mut x = seed ^ (rank as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ count as u64;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % 1025) as i64 - 512) as f32
        })
        .collect()
}

/// The CTAs for `count` floats (each thread handles 4 where `count` allows).
fn ctas(count: usize) -> u32 {
    let per_cta = THREADS as usize * if count.is_multiple_of(4) { 4 } else { 1 };
    count.div_ceil(per_cta).clamp(1, MAX_CTAS as usize) as u32
}

/// What the typed refusals made before NCCL was asked, for the report.
pub fn refusals(comms: &[Comm]) -> Res<Vec<String>> {
    let mut lines = Vec::new();
    let props = comms[0].properties()?;
    let library = comms[0].library().version();
    let abi = DeviceAbi::new(library);
    // Never asked where multicast exists: NVLS must stay off on the hosts this runs on.
    if !props.multimem_support {
        let reqs = DevCommRequirements::new().lsa_multimem(true);
        match DevComm::create_all(comms, &reqs, abi) {
            Err(err @ nccl::Error::Unavailable { .. }) => {
                lines.push(format!("lsaMultimem refused before NCCL: {err}"))
            }
            Err(err) => return Err(format!("lsaMultimem: expected Unavailable, got {err}").into()),
            Ok(_) => return Err("lsaMultimem accepted where multimemSupport is false".into()),
        }
    }
    if matches!(props.gin_type, None | Some(GinType::None)) {
        let reqs = DevCommRequirements::new()
            .gin(GinConnection::Full)
            .gin_signals(1);
        match DevComm::create_all(comms, &reqs, abi) {
            Err(err @ nccl::Error::Unavailable { .. }) => {
                lines.push(format!("GIN refused before NCCL: {err}"))
            }
            Err(err) => return Err(format!("GIN: expected Unavailable, got {err}").into()),
            Ok(_) => return Err("GIN accepted where the communicator has none".into()),
        }
    }
    Ok(lines)
}

/// The ranks of one run, their windows, device communicators and kernels.
pub struct Ranks<'c> {
    comms: &'c [Comm],
    inputs: Vec<Window<'c, f32>>,
    outputs: Vec<Window<'c, f32>>,
    dev_comms: Vec<DevComm<'c>>,
    kernels: Vec<CudaFunction>,
}

impl<'c> Ranks<'c> {
    /// Builds the kernel for every rank's GPU, registers the windows and creates the device
    /// communicators (collective: every rank, from this thread).
    pub fn new(comms: &'c [Comm], toolchain: &Toolchain) -> Res<Self> {
        // One build per GPU (ranks sharing a GPU share its primary context).
        let mut built: Vec<(usize, DeviceModule)> = Vec::new();
        let mut kernels = Vec::with_capacity(comms.len());
        for comm in comms {
            let ordinal = comm.context().ordinal();
            let module = match built.iter().find(|(o, _)| *o == ordinal) {
                Some((_, module)) => module.clone(),
                None => {
                    let module = toolchain.build(comm.context(), SOURCE)?;
                    built.push((ordinal, module.clone()));
                    module
                }
            };
            kernels.push(module.function(KERNEL)?);
        }
        let abi = toolchain.abi();
        let windows = |_| -> Res<Vec<Window<'c, f32>>> {
            let buffers = comms
                .iter()
                .map(|c| NcclBuffer::<f32>::alloc_zeros(c.stream(), MAX_BYTES / 4))
                .collect::<nccl::Result<Vec<_>>>()?;
            Ok(Comm::register_windows(
                comms,
                buffers,
                WindowFlags::COLL_SYMMETRIC,
            )?)
        };
        let inputs = windows(0)?;
        let outputs = windows(1)?;
        let reqs = DevCommRequirements::new().lsa_barriers(MAX_CTAS);
        let dev_comms = DevComm::create_all(comms, &reqs, abi)?;
        Ok(Self {
            comms,
            inputs,
            outputs,
            dev_comms,
            kernels,
        })
    }

    /// The LSA team's size (every rank's must be the communicator's: one LSA team).
    pub fn check_one_lsa_team(&self) -> Res<usize> {
        for dev_comm in &self.dev_comms {
            let lsa = dev_comm.lsa_team();
            if lsa.size != dev_comm.size() {
                return Err(format!(
                    "rank {}: LSA team of {} of {} ranks; this kernel needs all ranks in one",
                    dev_comm.rank(),
                    lsa.size,
                    dev_comm.size()
                )
                .into());
            }
        }
        // The host-side pointer queries agree: every peer reachable, no multicast.
        for window in &self.inputs {
            for peer in 0..self.dev_comms[0].lsa_team().size {
                window.lsa_ptr(peer, 0)?;
            }
            if window.lsa_multimem_ptr(0).is_ok() {
                return Err("a multicast pointer where NVLS is off".into());
            }
        }
        Ok(self.dev_comms[0].lsa_team().size)
    }

    /// The device kernel on every rank, `count` floats.
    fn launch(&mut self, count: usize) -> Res<()> {
        let cfg = LaunchConfig {
            grid_dim: (ctas(count), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        for r in 0..self.comms.len() {
            let stream = self.comms[r].stream();
            let mut input = self.inputs[r].device_window()?;
            let mut output = self.outputs[r].device_window()?;
            // SAFETY: the kernel takes (const ncclDevComm*, ncclWindow_t, ncclWindow_t,
            // size_t) and the device communicator was created for its ABI; it reads `count`
            // floats of every LSA peer's input window and writes `count` of this rank's
            // output window, all MAX_BYTES long; its grid (at most MAX_CTAS, the LSA
            // barriers requested) is the same on every rank, and every rank's kernel is
            // launched before any is waited for.
            unsafe {
                stream
                    .launch_builder(&self.kernels[r])
                    .arg(&self.dev_comms[r])
                    .arg(&mut input)
                    .arg(&mut output)
                    .arg(&count)
                    .launch(cfg)?;
            }
        }
        Ok(())
    }

    /// `ncclAllReduce` from the input windows into the output windows, one group.
    fn nccl_all_reduce(&mut self, count: usize) -> Res<()> {
        let ins = self
            .inputs
            .iter()
            .map(|w| w.view(0..count))
            .collect::<nccl::Result<Vec<_>>>()?;
        let mut outs = self
            .outputs
            .iter_mut()
            .map(|w| w.view_mut(0..count))
            .collect::<nccl::Result<Vec<_>>>()?;
        let mut group = Group::start()?;
        for ((comm, send), recv) in self.comms.iter().zip(&ins).zip(outs.iter_mut()) {
            group.enqueue(comm, Operation::all_reduce(send, recv, ReduceOp::Sum))?;
        }
        group.finish()?;
        Ok(())
    }

    fn sync(&self) -> Res<()> {
        for comm in self.comms {
            comm.synchronize_timeout(SYNC)?;
        }
        Ok(())
    }

    /// Fills the inputs with fresh random data and the outputs with NaN; the reference.
    fn prepare(&mut self, count: usize, seed: u64) -> Res<Vec<f32>> {
        let mut want = vec![0f32; count];
        for r in 0..self.comms.len() {
            let data = input(r, count, seed);
            for (w, x) in want.iter_mut().zip(&data) {
                *w += x;
            }
            let stream = self.comms[r].stream();
            stream.memcpy_htod(&data, &mut self.inputs[r].view_mut(0..count)?)?;
            stream.memcpy_htod(
                &vec![f32::NAN; count],
                &mut self.outputs[r].view_mut(0..count)?,
            )?;
        }
        Ok(want)
    }

    fn verify(&self, what: &str, count: usize, want: &[f32]) -> Res<()> {
        for r in 0..self.comms.len() {
            let got = self.comms[r]
                .stream()
                .clone_dtoh(&self.outputs[r].view(0..count)?)?;
            if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
                return Err(format!(
                    "{what}, {} bytes: rank {r} element {i} is {}, expected {} (host reference)",
                    count * 4,
                    got[i],
                    want[i]
                )
                .into());
            }
        }
        Ok(())
    }

    /// Checks the device kernel, then `ncclAllReduce`, for `bytes`, on fresh random data.
    pub fn check(&mut self, bytes: usize, seed: u64) -> Res<()> {
        let count = bytes / 4;
        let want = self.prepare(count, seed)?;
        self.launch(count)?;
        self.sync()?;
        self.verify("device kernel", count, &want)?;
        let want = self.prepare(count, seed.wrapping_add(1))?;
        self.nccl_all_reduce(count)?;
        self.sync()?;
        self.verify("ncclAllReduce", count, &want)
    }

    /// Mean µs per call of `run` over `iters` calls after 5 warm-up calls, by events on rank 0's
    /// stream (which waits for every rank through the barriers or NCCL).
    fn time(
        &mut self,
        count: usize,
        iters: usize,
        run: fn(&mut Self, usize) -> Res<()>,
    ) -> Res<f64> {
        for _ in 0..5 {
            run(self, count)?;
        }
        self.sync()?;
        let stream = self.comms[0].stream().clone();
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..iters {
            run(self, count)?;
        }
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        self.sync()?;
        Ok(f64::from(start.elapsed_ms(&end)?) * 1000.0 / iters as f64)
    }

    /// (device-kernel µs, ncclAllReduce µs) for `bytes`.
    pub fn timings(&mut self, bytes: usize, iters: usize) -> Res<(f64, f64)> {
        let kernel = self.time(bytes / 4, iters, Self::launch)?;
        let nccl = self.time(bytes / 4, iters, Self::nccl_all_reduce)?;
        Ok((kernel, nccl))
    }
}
