//! Command-line flags, after nccl-tests' (`-b -e -i -f -n -w -c -o -d -r -a -G -C -R`), plus
//! this benchmark's own long options.
//!
//! Past 600 lines: the help text, the parser and the checks between flags are one table read
//! side by side, with their tests; splitting them would scatter each flag over three files.

use std::path::PathBuf;

use nccl::{Construction, DataType, ReduceOp};

use crate::coll::{Coll, SplitSpec};
use crate::elem;
use crate::ops::Api;
use crate::splits::{Splits, DEFAULT_SEED};

/// How the per-rank times of one measurement are combined (nccl-tests' `-a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's time (`-a 0`).
    Rank0,
    /// The mean over the ranks (`-a 1`, the default).
    Mean,
    /// The smallest (`-a 2`).
    Min,
    /// The largest (`-a 3`).
    Max,
}

/// Which API issues the timed operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apis {
    /// The safe API only (the default).
    Safe,
    /// Raw nccl-sys calls only (`--raw`).
    Raw,
    /// Both, side by side (`--compare`).
    Compare,
    /// NCCL's all-reduce through the safe API beside the kernels nccl-rs ships (`--lsa`).
    Lsa(nccl::device::LsaAlgorithm),
}

impl Apis {
    /// The APIs measured, in the order of the columns.
    pub fn list(self) -> &'static [Api] {
        match self {
            Apis::Safe => &[Api::Safe],
            Apis::Raw => &[Api::Raw],
            Apis::Compare => &[Api::Safe, Api::Raw],
            Apis::Lsa(algorithm) => {
                use nccl::device::LsaAlgorithm as A;
                match algorithm {
                    A::OneShotFlags => &[Api::Safe, Api::Lsa(A::OneShotFlags)],
                    A::OneShotBarrier => &[Api::Safe, Api::Lsa(A::OneShotBarrier)],
                    A::TwoShotFlags => &[Api::Safe, Api::Lsa(A::TwoShotFlags)],
                    _ => &[Api::Safe, Api::Lsa(A::Auto)],
                }
            }
        }
    }

    /// The two APIs of a side-by-side report.
    pub fn pair(self) -> Option<(Api, Api)> {
        match self.list() {
            [first, second] => Some((*first, *second)),
            _ => None,
        }
    }
}

/// How an operation is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Back-to-back launches timed on the host between synchronisations (nccl-tests' way).
    Host,
    /// `iters` operations captured in a CUDA graph, replayed `-G` times.
    Graph,
    /// Every call timed with CUDA events: median and 99th percentile.
    Latency,
    /// Every call follows other host work (`--cold`): the call path as a program meets it,
    /// with the binding's code and data evicted from the caches.
    Cold,
}

/// How the benchmark's buffers are registered with NCCL (nccl-tests' `-R`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterMode {
    /// `-R 0`: not registered (the default).
    None,
    /// `-R 1`: local registration, `ncclCommRegister` through `Comm::register`.
    Local,
    /// `-R 2`: symmetric windows, `ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`
    /// through `Comm::register_window` (NCCL 2.28.7 here).
    Window,
}

impl RegisterMode {
    /// nccl-tests' number for it.
    pub fn flag(self) -> u8 {
        match self {
            RegisterMode::None => 0,
            RegisterMode::Local => 1,
            RegisterMode::Window => 2,
        }
    }

    /// What it is, for the output.
    pub fn describe(self) -> &'static str {
        match self {
            RegisterMode::None => "not registered (-R 0)",
            RegisterMode::Local => "registered locally with ncclCommRegister (-R 1)",
            RegisterMode::Window => "symmetric windows, ncclCommWindowRegister (-R 2)",
        }
    }
}

/// Where device memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alloc {
    /// `ncclMemAlloc`, as nccl-tests does with NCCL 2.19 and newer (the default).
    Nccl,
    /// cudarc's allocator (`cuMemAllocAsync` where available).
    Cuda,
}

/// Everything the command line says.
#[derive(Debug, Clone)]
pub struct Options {
    /// The operation.
    pub coll: Coll,
    /// Smallest size in bytes (`-b`).
    pub min_bytes: usize,
    /// Largest size in bytes (`-e`).
    pub max_bytes: usize,
    /// Additive step (`-i`), used when the factor is 1.
    pub step_bytes: usize,
    /// Multiplicative step (`-f`).
    pub step_factor: usize,
    /// Timed iterations per size (`-n`).
    pub iters: usize,
    /// Warm-up iterations (`-w`).
    pub warmup: usize,
    /// Data checks per size (`-c`; 0 turns checking off).
    pub check: usize,
    /// Reductions to run (`-o`).
    pub ops: Vec<ReduceOp>,
    /// Element types to run (`-d`).
    pub dtypes: Vec<DataType>,
    /// Root of broadcast and reduce (`-r`).
    pub root: usize,
    /// Graph replays (`-G`); more than 0 selects graph mode.
    pub graph_launches: usize,
    /// Per-call latency mode (`--latency`).
    pub latency: bool,
    /// Bytes of host memory traffic before every call (`--cold`); 0 is off.
    pub cold_bytes: usize,
    /// With `--compare`, issue raw calls in both columns (`--control`).
    pub control: bool,
    /// Print NCCL's estimate (`Group::simulate`) beside each measured row (`--simulate`).
    pub simulate: bool,
    /// How per-rank times are combined (`-a`).
    pub average: Average,
    /// Report the host time spent issuing instead of the time to completion (`-C 1`).
    pub cputime: bool,
    /// Which API issues the operations.
    pub apis: Apis,
    /// Measurements per API and size in `--compare` mode; the median is reported.
    pub rounds: usize,
    /// Processes to start when no launcher started this one (`--ranks`).
    pub ranks: Option<usize>,
    /// cudarc's event tracking on the benchmark's buffers (`--event-tracking`).
    pub event_tracking: bool,
    /// Run on a stream of the process's own instead of the GPU's default stream
    /// (`--stream own`).
    pub own_stream: bool,
    /// Where buffers come from (`--alloc`).
    pub alloc: Alloc,
    /// Write every measurement as JSON here (`--json`).
    pub json: Option<PathBuf>,
    /// Write every measurement as CSV here (`--csv`).
    pub csv: Option<PathBuf>,
    /// Draw busbw against size as SVG here (`--plot`).
    pub plot: Option<PathBuf>,
    /// Buffer registration (`-R`); `None` when not given.
    pub register: Option<RegisterMode>,
    /// Measure without registration and with symmetric windows, and print the speedup
    /// (`--registration-compare`).
    pub registration_compare: bool,
    /// How the v-collectives split their totals (`--splits`).
    pub splits: Splits,
    /// The split matrix's seed (`--seed`).
    pub seed: u64,
    /// all_gather_v's construction (`--construction`).
    pub construction: Construction,
    /// A collective measured first on the same sizes, with the ratio of times printed after
    /// (`--versus`).
    pub versus: Option<Coll>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            coll: Coll::AllReduce,
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            step_bytes: 1 << 20,
            step_factor: 1,
            iters: 20,
            warmup: 5,
            check: 1,
            ops: vec![ReduceOp::Sum],
            dtypes: vec![DataType::Float32],
            root: 0,
            graph_launches: 0,
            latency: false,
            cold_bytes: 0,
            control: false,
            simulate: false,
            average: Average::Mean,
            cputime: false,
            apis: Apis::Safe,
            rounds: 1,
            ranks: None,
            event_tracking: true,
            own_stream: false,
            alloc: Alloc::Nccl,
            json: None,
            csv: None,
            plot: None,
            register: None,
            registration_compare: false,
            splits: Splits::Even,
            seed: DEFAULT_SEED,
            construction: Construction::Auto,
            versus: None,
        }
    }
}

impl Options {
    /// How the v-collectives split their totals.
    pub fn split_spec(&self) -> SplitSpec {
        SplitSpec {
            splits: self.splits,
            seed: self.seed,
        }
    }

    /// The timing mode the flags select.
    pub fn mode(&self) -> Mode {
        if self.latency {
            Mode::Latency
        } else if self.cold_bytes > 0 {
            Mode::Cold
        } else if self.graph_launches > 0 {
            Mode::Graph
        } else {
            Mode::Host
        }
    }

    /// The registrations to measure, in order: one, or without and with windows for
    /// `--registration-compare`. The one-sided put ring always runs on windows.
    pub fn registrations(&self) -> Vec<RegisterMode> {
        if self.registration_compare {
            vec![RegisterMode::None, RegisterMode::Window]
        } else if self.coll == Coll::PutSignal {
            vec![RegisterMode::Window]
        } else {
            vec![self.register.unwrap_or(RegisterMode::None)]
        }
    }

    /// The sizes to run, in bytes, in order.
    pub fn sizes(&self) -> Vec<usize> {
        let mut sizes = Vec::new();
        let mut size = self.min_bytes;
        while size <= self.max_bytes {
            sizes.push(size);
            let next = if self.step_factor > 1 {
                size.checked_mul(self.step_factor)
            } else {
                size.checked_add(self.step_bytes)
            };
            match next {
                // A zero minimum with a factor would never grow.
                Some(next) if next > size => size = next,
                _ => break,
            }
        }
        sizes
    }
}

/// The outcome of parsing: run, or print the help and stop.
#[derive(Debug)]
pub enum Parsed {
    /// Run with these options.
    Run(Box<Options>),
    /// `-h`/`--help` was given.
    Help,
}

/// The help text.
pub fn usage() -> String {
    let colls: Vec<&str> = Coll::ALL.iter().map(|c| c.name()).collect();
    let types: Vec<&str> = elem::TYPES.iter().map(|(_, name, _)| *name).collect();
    format!(
        "\
usage: bench [COLLECTIVE] [options]

COLLECTIVE: {colls} (default all_reduce)

nccl-tests flags:
  -b, --minbytes <size>        smallest size, e.g. 8, 64K, 128M, 1G (default 32M)
  -e, --maxbytes <size>        largest size (default 32M)
  -i, --stepbytes <size>       additive step when the factor is 1 (default 1M)
  -f, --stepfactor <n>         multiplicative step (default 1)
  -n, --iters <n>              timed iterations per size (default 20)
  -w, --warmup_iters <n>       warm-up iterations (default 5)
  -c, --check <n>              data checks per size, 0 = off (default 1)
  -o, --op <op>                sum, prod, max, min, avg or all (default sum)
  -d, --datatype <type>        {types} or all (default float)
  -r, --root <rank>            root of broadcast and reduce (default 0)
  -G, --cudagraph <n>          capture the iterations in a CUDA graph, replay it n times
  -a, --average <0|1|2|3>      combine per-rank times: rank 0, mean, min, max (default 1)
  -C, --report_cputime <0|1>   report the host time spent issuing (default 0)
  -R, --local_register <0|1|2>
                               0: buffers not registered (default); 1: registered with
                               ncclCommRegister (Comm::register, NCCL 2.19); 2: symmetric
                               windows (Comm::register_window with COLL_SYMMETRIC, send and
                               receive buffer one window each, operations on window views;
                               NCCL 2.28.7, below that the run says so and exits 0). The raw
                               path uses the same registered memory and pointers. 1 and 2
                               need --alloc nccl

this benchmark's own:
      --raw                    issue through raw nccl-sys calls instead of the safe API
      --compare                issue through both and print them side by side
      --rounds <n>             with --compare: measurements per API, median reported, and
                               the median of the per-round ratios (default 1)
      --lsa <flags|twoshot|barrier|auto>
                               all_reduce (sum) through the kernels nccl-rs ships
                               (nccl::device::LsaAllReduce: one-shot with flags, two-shot
                               with flags, one-shot with NCCL's LSA barrier, or chosen by
                               size) beside NCCL's
                               own through the safe API, in the same run; f32, bf16, f16;
                               every rank in one LSA team; NCCL 2.29.2+. With all_gather
                               and --lsa flags: the LL all-gather kernel beside NCCL's
                               all_gather (out of place only)
      --control                with --compare: both columns issue raw calls, which shows how
                               far apart the comparison puts two identical paths
      --simulate               after each row, a comment line with NCCL's own estimate of
                               the operation's time (Group::simulate, ncclGroupSimulateEnd,
                               NCCL 2.22; nothing launched) beside the measured time, for
                               all_reduce, all_gather, reduce_scatter, broadcast and reduce
      --latency                time every call with CUDA events: median and p99
      --cold <size>            write and read <size> of other host memory before every call
                               (the calls run cache-cold, as after a program's own work);
                               -C 1 then shows the median host time of one call
      --ranks <n>              processes to start without a launcher (default: every GPU)
      --stream <default|own>   the GPU's default stream (default) or a stream of its own
                               (graph mode always uses its own)
      --event-tracking <0|1>   cudarc's event tracking on the buffers, active only with a
                               stream of its own (default 1; off in graph mode)
      --alloc <nccl|cuda>      ncclMemAlloc (default, as nccl-tests) or cudarc's allocator
      --registration-compare   run everything without registration (-R 0) and then on
                               symmetric windows (-R 2), and print the speedup of -R 2
      --rma                    the put_signal ring instead of a collective (same as the
                               collective put_signal): every rank puts size bytes from its
                               send window into the next rank's receive window
                               (Window::put_signal) and waits for the previous rank's signal
                               (Window::wait_signal); busbw = algbw = size / time. Always on
                               symmetric windows; NCCL 2.29
      --versus <collective>    measure this fixed-size collective first on the same sizes,
                               then the one asked for, and print time(versus) / time(it)
                               for every row (above 1: it is faster), e.g.
                               all_to_all_v --splits even --versus alltoall

variable-size collectives (all_to_all_v, all_gather_v, reduce_scatter_v):
      --splits <even|zipf:S>   how each total is split over the ranks (default even): equal
                               parts, or parts proportional to 1/k^S (k = 1..n, a destination's
                               rank in each sender's own seeded order; e.g. zipf:1.1). Exact:
                               every row sums to its total. all_to_all_v: an n x n matrix,
                               row i what rank i sends to each rank; all_gather_v and
                               reduce_scatter_v: one row, each rank's segment
      --seed <n>               the split matrix's seed, the same on every rank (default 1);
                               benches/torch_all_to_all_single.py builds the same matrix
      --construction <auto|collective|p2p>
                               all_gather_v only: grouped send/receive (p2p, what auto
                               picks) or grouped broadcasts (collective); --compare's raw
                               path builds the same one
  The raw path (--raw, --compare) issues the same NCCL calls in one group (ncclSend/ncclRecv
  per peer, ncclBroadcast or ncclReduce per root), so safe/raw isolates the binding.
  Sizes are those of the fixed-size counterpart (all_to_all_v: each rank's send buffer, as
  alltoall; all_gather_v: the receive buffer; reduce_scatter_v: the send buffer), rounded to
  n elements, so all_to_all_v --splits even moves exactly what alltoall moves. algbw = size
  / time. busbw = B / time, B the bytes the busiest rank sends to or receives from the other
  ranks (its own segment stays local): all_to_all_v max over r of max(sum over j!=r of M[r][j],
  sum over i!=r of M[i][r]); all_gather_v and reduce_scatter_v max over r of (total - c_r). With
  even splits B = size x (n-1)/n: the fixed-size collective's busbw. The check compares each
  rank's output with a host reference of what the matrix says it receives.

      --json <file>            write every measurement as JSON
      --csv <file>             write every measurement as CSV
      --plot <file.svg>        draw busbw against size
  -h, --help                   this text

Sizes are bytes of the whole buffer as in nccl-tests: for all_gather the receive buffer, for
reduce_scatter the send buffer, for alltoall either buffer, for put_signal the bytes each rank
puts. With --registration-compare, --json, --csv and --plot files get -R0 and -R2 added to
their names; with --versus, the collective's name.",
        colls = colls.join(", "),
        types = types.join(", ")
    )
}

/// Parses the arguments after the program name.
pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Parsed, String> {
    let mut options = Options::default();
    let mut coll_given = false;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Parsed::Help);
        }
        if arg == "--" {
            // `cargo run --example bench -- ...` and runners passing it through.
            continue;
        }
        if !arg.starts_with('-') || arg == "-" {
            let coll = Coll::parse(&arg)
                .ok_or_else(|| format!("unknown collective {arg:?} (try --help)"))?;
            if coll_given && coll != options.coll {
                return Err(format!("only one collective per run (got {arg:?} as well)"));
            }
            options.coll = coll;
            coll_given = true;
            continue;
        }
        // Split "--name=value", "-bVALUE" and "-b VALUE" forms.
        let (name, inline) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((name, value)) => (format!("--{name}"), Some(value.to_string())),
                None => (arg.clone(), None),
            }
        } else if arg.len() > 2 && arg.is_char_boundary(2) {
            (arg[..2].to_string(), Some(arg[2..].to_string()))
        } else {
            (arg.clone(), None)
        };
        match name.as_str() {
            "--raw"
            | "--compare"
            | "--latency"
            | "--control"
            | "--simulate"
            | "--rma"
            | "--registration-compare" => {
                if inline.is_some() {
                    return Err(format!("{name} takes no value"));
                }
                match name.as_str() {
                    "--raw" => options.apis = Apis::Raw,
                    "--compare" => options.apis = Apis::Compare,
                    "--control" => options.control = true,
                    "--simulate" => options.simulate = true,
                    "--registration-compare" => options.registration_compare = true,
                    "--rma" => {
                        if coll_given && options.coll != Coll::PutSignal {
                            return Err(format!(
                                "--rma runs the put_signal ring; it cannot be combined with {}",
                                options.coll.name()
                            ));
                        }
                        options.coll = Coll::PutSignal;
                        coll_given = true;
                    }
                    _ => options.latency = true,
                }
                continue;
            }
            _ => {}
        }
        let mut value = || -> Result<String, String> {
            match inline.clone() {
                Some(value) => Ok(value),
                None => args.next().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match name.as_str() {
            "-b" | "--minbytes" => options.min_bytes = size(&name, &value()?)?,
            "-e" | "--maxbytes" => options.max_bytes = size(&name, &value()?)?,
            "-i" | "--stepbytes" => options.step_bytes = size(&name, &value()?)?,
            "-f" | "--stepfactor" => options.step_factor = number(&name, &value()?)?,
            "-n" | "--iters" => options.iters = number(&name, &value()?)?,
            "-w" | "--warmup_iters" => options.warmup = number(&name, &value()?)?,
            "-c" | "--check" => options.check = number(&name, &value()?)?,
            "-r" | "--root" => options.root = number(&name, &value()?)?,
            "-G" | "--cudagraph" => options.graph_launches = number(&name, &value()?)?,
            "--cold" => options.cold_bytes = size(&name, &value()?)?,
            "-C" | "--report_cputime" => options.cputime = flag(&name, &value()?)?,
            "-a" | "--average" => {
                options.average = match number(&name, &value()?)? {
                    0 => Average::Rank0,
                    1 => Average::Mean,
                    2 => Average::Min,
                    3 => Average::Max,
                    other => return Err(format!("{name}: expected 0, 1, 2 or 3, got {other}")),
                }
            }
            "-o" | "--op" => {
                let text = value()?;
                options.ops = match text.to_ascii_lowercase().as_str() {
                    "all" => ReduceOp::ALL.to_vec(),
                    op => vec![ReduceOp::ALL
                        .into_iter()
                        .find(|o| o.name() == op)
                        .ok_or_else(|| {
                            format!("{name}: unknown reduction {text:?} (sum, prod, max, min, avg, all)")
                        })?],
                };
            }
            "-d" | "--datatype" => {
                let text = value()?;
                options.dtypes = if text.eq_ignore_ascii_case("all") {
                    elem::TYPES.iter().map(|(dtype, ..)| *dtype).collect()
                } else {
                    vec![elem::parse(&text).ok_or_else(|| {
                        format!("{name}: unknown data type {text:?} (try --help)")
                    })?]
                };
            }
            "--rounds" => options.rounds = number(&name, &value()?)?,
            "--lsa" => {
                let text = value()?;
                options.apis = Apis::Lsa(crate::lsa::parse(&text).ok_or_else(|| {
                    format!("{name}: expected flags, twoshot, barrier or auto, got {text:?}")
                })?);
            }
            "--ranks" => options.ranks = Some(number(&name, &value()?)?),
            "--event-tracking" => options.event_tracking = flag(&name, &value()?)?,
            "--stream" => {
                options.own_stream = match value()?.as_str() {
                    "default" => false,
                    "own" => true,
                    other => return Err(format!("{name}: expected default or own, got {other:?}")),
                }
            }
            "--alloc" => {
                options.alloc = match value()?.as_str() {
                    "nccl" => Alloc::Nccl,
                    "cuda" | "cudarc" => Alloc::Cuda,
                    other => return Err(format!("{name}: expected nccl or cuda, got {other:?}")),
                }
            }
            "-R" | "--local_register" => {
                options.register = Some(match number(&name, &value()?)? {
                    0 => RegisterMode::None,
                    1 => RegisterMode::Local,
                    2 => RegisterMode::Window,
                    other => return Err(format!("{name}: expected 0, 1 or 2, got {other}")),
                })
            }
            "--splits" => options.splits = Splits::parse(&value()?)?,
            "--seed" => options.seed = number(&name, &value()?)? as u64,
            "--construction" => {
                options.construction = match value()?.to_ascii_lowercase().as_str() {
                    "auto" => Construction::Auto,
                    "collective" => Construction::Collective,
                    "p2p" | "point-to-point" => Construction::PointToPoint,
                    other => {
                        return Err(format!(
                            "{name}: expected auto, collective or p2p, got {other:?}"
                        ))
                    }
                }
            }
            "--versus" => {
                let text = value()?;
                options.versus = Some(
                    Coll::parse(&text)
                        .ok_or_else(|| format!("{name}: unknown collective {text:?}"))?,
                );
            }
            "--json" => options.json = Some(value()?.into()),
            "--csv" => options.csv = Some(value()?.into()),
            "--plot" => options.plot = Some(value()?.into()),
            "-t" | "--nthreads" | "-g" | "--ngpus" | "-m" | "--agg_iters" | "-N"
            | "--run_cycles" | "-p" | "--parallel_init" | "-z" | "--blocking" | "-y"
            | "--stream_null" | "-T" | "--timeout" => {
                return Err(format!(
                    "{name} is an nccl-tests flag this benchmark does not implement (one \
                     process per GPU; see --help)"
                ))
            }
            _ => return Err(format!("unknown option {arg:?} (try --help)")),
        }
    }
    validate(&options)?;
    Ok(Parsed::Run(Box::new(options)))
}

fn validate(options: &Options) -> Result<(), String> {
    if options.min_bytes > options.max_bytes {
        return Err(format!(
            "invalid sizes: minbytes {} > maxbytes {}",
            options.min_bytes, options.max_bytes
        ));
    }
    if options.step_factor == 0 {
        return Err("the step factor (-f) must be at least 1".into());
    }
    if options.step_factor == 1 && options.step_bytes == 0 && options.min_bytes < options.max_bytes
    {
        return Err("with a step factor of 1 the step (-i) must be more than 0".into());
    }
    if options.iters == 0 {
        return Err("at least one iteration is needed (-n)".into());
    }
    if options.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    if let Apis::Lsa(algorithm) = options.apis {
        let gather = options.coll == Coll::AllGather
            && algorithm == nccl::device::LsaAlgorithm::OneShotFlags;
        let sum = options.coll == Coll::AllReduce && options.ops == [ReduceOp::Sum];
        if !gather && !sum {
            return Err("--lsa runs all_reduce with -o sum, or all_gather with --lsa flags".into());
        }
    }
    if options.control && options.apis != Apis::Compare {
        return Err("--control only makes sense with --compare".into());
    }
    if options.latency && options.graph_launches > 0 {
        return Err("--latency and -G (graph mode) cannot be combined".into());
    }
    if options.cold_bytes > 0 && (options.latency || options.graph_launches > 0) {
        return Err("--cold times host calls; it cannot be combined with --latency or -G".into());
    }
    if options.registration_compare && options.register.is_some() {
        return Err("--registration-compare measures -R 0 and -R 2 itself; drop -R".into());
    }
    if options.coll == Coll::PutSignal {
        if options.registration_compare {
            return Err("the put_signal ring (--rma) runs on windows only; \
                        --registration-compare has nothing to compare it with"
                .into());
        }
        if matches!(options.register, Some(r) if r != RegisterMode::Window) {
            return Err("the put_signal ring (--rma) needs symmetric windows (-R 2)".into());
        }
    }
    let registers = options
        .registrations()
        .iter()
        .any(|&r| r != RegisterMode::None);
    if registers && options.alloc != Alloc::Nccl {
        return Err(
            "registration (-R 1/2, --rma, --registration-compare) needs buffers from \
                    ncclMemAlloc (--alloc nccl)"
                .into(),
        );
    }
    if !options.coll.is_v() {
        let v_flag = if options.splits != Splits::Even {
            Some("--splits")
        } else if options.seed != DEFAULT_SEED {
            Some("--seed")
        } else if options.construction != Construction::Auto {
            Some("--construction")
        } else {
            None
        };
        if let Some(flag) = v_flag {
            return Err(format!(
                "{flag} applies to all_to_all_v, all_gather_v and reduce_scatter_v, not {}",
                options.coll.name()
            ));
        }
    }
    if options.construction != Construction::Auto && options.coll != Coll::AllGatherV {
        return Err(format!(
            "--construction: only all_gather_v has more than one construction ({} has one)",
            options.coll.name()
        ));
    }
    if let Some(versus) = options.versus {
        if versus == options.coll {
            return Err("--versus needs a collective other than the one measured".into());
        }
        if versus == Coll::PutSignal || options.coll == Coll::PutSignal {
            return Err("--versus cannot be combined with the put_signal ring (--rma)".into());
        }
        if versus.is_v() {
            return Err(format!(
                "--versus {}: the reference must be a fixed-size collective (the splits \
                 apply to the measured one)",
                versus.name()
            ));
        }
        if options.registration_compare {
            return Err("--versus and --registration-compare cannot be combined".into());
        }
    }
    if options.ranks == Some(0) {
        return Err("--ranks must be at least 1".into());
    }
    if options.sizes().len() > 10_000 {
        return Err(format!(
            "{} sizes between {} and {} bytes; use a larger step",
            options.sizes().len(),
            options.min_bytes,
            options.max_bytes
        ));
    }
    Ok(())
}

/// Parses a size like nccl-tests: a number with an optional K, M or G (powers of 1024),
/// optionally followed by `B` or `iB`.
fn size(name: &str, text: &str) -> Result<usize, String> {
    let bad = || format!("{name}: invalid size {text:?} (e.g. 8, 64K, 128M, 1G)");
    let trimmed = text.trim();
    let lower = trimmed.to_ascii_lowercase();
    let stripped = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (number, unit) = match stripped.chars().last() {
        Some('k') => (&stripped[..stripped.len() - 1], 1u64 << 10),
        Some('m') => (&stripped[..stripped.len() - 1], 1 << 20),
        Some('g') => (&stripped[..stripped.len() - 1], 1 << 30),
        Some('t') => (&stripped[..stripped.len() - 1], 1 << 40),
        _ => (stripped, 1),
    };
    let value: f64 = number.trim().parse().map_err(|_| bad())?;
    let bytes = value * unit as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > usize::MAX as f64 / 2.0 {
        return Err(bad());
    }
    Ok(bytes as usize)
}

fn number(name: &str, text: &str) -> Result<usize, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{name}: expected a non-negative integer, got {text:?}"))
}

fn flag(name: &str, text: &str) -> Result<bool, String> {
    match text.trim() {
        "0" | "false" | "off" | "no" => Ok(false),
        "1" | "true" | "on" | "yes" => Ok(true),
        _ => Err(format!("{name}: expected 0 or 1, got {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Options, String> {
        match parse(args.iter().map(|a| a.to_string()))? {
            Parsed::Run(options) => Ok(*options),
            Parsed::Help => Err("help".into()),
        }
    }

    #[test]
    fn registration_flags_select_what_is_measured() {
        assert_eq!(run(&[]).unwrap().registrations(), [RegisterMode::None]);
        for (text, mode) in [
            ("0", RegisterMode::None),
            ("1", RegisterMode::Local),
            ("2", RegisterMode::Window),
        ] {
            let options = run(&["all_gather", "-R", text]).unwrap();
            assert_eq!(options.registrations(), [mode]);
            assert_eq!(mode.flag().to_string(), text);
            let long = run(&[&format!("--local_register={text}")]).unwrap();
            assert_eq!(long.register, Some(mode));
        }
        assert!(run(&["-R", "3"])
            .unwrap_err()
            .contains("expected 0, 1 or 2"));
        let both = run(&["alltoall", "--registration-compare"]).unwrap();
        assert_eq!(
            both.registrations(),
            [RegisterMode::None, RegisterMode::Window]
        );
        assert!(run(&["--registration-compare", "-R", "2"])
            .unwrap_err()
            .contains("drop -R"));
        // Registered memory is ncclMemAlloc's.
        for args in [
            &["-R", "1", "--alloc", "cuda"][..],
            &["--registration-compare", "--alloc", "cuda"],
            &["--rma", "--alloc", "cuda"],
        ] {
            assert!(run(args).unwrap_err().contains("--alloc nccl"), "{args:?}");
        }
    }

    #[test]
    fn simulate_is_a_flag_without_a_value() {
        assert!(!run(&[]).unwrap().simulate);
        assert!(run(&["all_gather", "--simulate"]).unwrap().simulate);
        assert!(run(&["--simulate=1"]).is_err());
    }

    #[test]
    fn rma_is_the_put_signal_ring_on_windows() {
        let options = run(&["--rma", "-b", "8", "-e", "1M", "-f", "2"]).unwrap();
        assert_eq!(options.coll, Coll::PutSignal);
        assert_eq!(options.registrations(), [RegisterMode::Window]);
        assert_eq!(run(&["put_signal", "--rma"]).unwrap().coll, Coll::PutSignal);
        assert_eq!(run(&["rma", "-R", "2"]).unwrap().coll, Coll::PutSignal);
        assert!(run(&["all_reduce", "--rma"])
            .unwrap_err()
            .contains("cannot be combined"));
        assert!(run(&["--rma", "all_reduce"])
            .unwrap_err()
            .contains("one collective"));
        assert!(run(&["--rma", "-R", "1"]).unwrap_err().contains("-R 2"));
        assert!(run(&["--rma", "--registration-compare"]).is_err());
        assert!(usage().contains("--rma") && usage().contains("-R, --local_register"));
    }

    #[test]
    fn split_flags_belong_to_the_v_collectives() {
        let options = run(&["all_to_all_v", "--splits", "zipf:1.1", "--seed", "7"]).unwrap();
        assert_eq!(options.coll, Coll::AllToAllV);
        assert_eq!(options.splits, Splits::Zipf(1.1));
        assert_eq!(options.seed, 7);
        assert_eq!(run(&["a2av"]).unwrap().splits, Splits::Even);
        assert!(run(&["alltoall", "--splits", "zipf:1.1"])
            .unwrap_err()
            .contains("--splits applies"));
        assert!(run(&["all_to_all_v", "--splits", "zipf:-1"]).is_err());
        let gather = run(&["all_gather_v", "--construction", "p2p"]).unwrap();
        assert_eq!(gather.construction, Construction::PointToPoint);
        assert!(run(&["all_to_all_v", "--construction", "p2p"])
            .unwrap_err()
            .contains("only all_gather_v"));
        assert!(run(&["all_gather_v", "--construction", "ring"]).is_err());
        let versus = run(&["all_to_all_v", "--versus", "alltoall"]).unwrap();
        assert_eq!(versus.versus, Some(Coll::AllToAll));
        assert!(run(&["alltoall", "--versus", "alltoall"]).is_err());
        assert!(run(&["alltoall", "--versus", "all_to_all_v"]).is_err());
        assert!(run(&[
            "all_to_all_v",
            "--versus",
            "alltoall",
            "--registration-compare"
        ])
        .is_err());
        for name in [
            "all_to_all_v",
            "all_gather_v",
            "reduce_scatter_v",
            "--splits",
            "--versus",
        ] {
            assert!(usage().contains(name), "{name}");
        }
    }
}
