//! The kernels' `State` (`allreduce.cu`) as a Rust type: the host builds an instance's state
//! as a [`KernelState`], copies it to the device once, and takes the offsets it writes at
//! (the stop's `timed_out`) from the type; the tests check the type against the layout
//! table compiled into the shipped images, so neither side can change alone.

use cudarc::driver::DeviceRepr;

use super::epilogue::SPLIT_ROWS;
use super::{FLAGS_MAX_CTAS, MAX_CTAS, NORM_CHUNKS};

/// `State` of `allreduce.cu`, field for field: the kernels' call counters, the words they
/// set when they give up, and the fused kernel's exchange of partial sums, kept in device
/// memory so that CUDA graphs can replay the kernels. Built by [`KernelState::new`] and
/// copied to the device once; from then on only the kernels and the instance's stop (which
/// sets `timed_out`) write it. The `unused` words are the kernels' too (kept so that no
/// offset moves).
#[repr(C)]
pub(super) struct KernelState {
    unused0: [u64; 2],
    /// Bytes per slot the flags call that used buffer i wrote (the next call clears that
    /// much of the buffer).
    flags_bytes: [u64; 3],
    unused1: u64,
    /// Nonzero once a kernel of the instance gave up waiting, or the instance was stopped:
    /// every later kernel then returns at once.
    pub(super) timed_out: u32,
    pad: u32,
    /// The device address of the host-mapped word (`setup::HostWords`) a kernel sets when it
    /// gives up, so that the host refuses further launches without waiting for the GPU.
    gave_up: u64,
    /// Norm partials the flags call that used buffer i wrote (cleared as `flags_bytes`).
    partial_floats: [u64; 3],
    unused2: u64,
    /// Each CTA's count of the flags calls made (one-shot, two-shot, all-gather, fused).
    flags_calls: [u64; FLAGS_MAX_CTAS as usize],
    /// Each CTA's count of the barrier calls made.
    barrier_calls: [u64; MAX_CTAS as usize],
    /// The split norm's chunk sums of squares, a buffer per flags buffer: sentinels (-0.0,
    /// which no sum of squares is) until written.
    partials: [[f32; SPLIT_ROWS * NORM_CHUNKS]; 3],
}

// Every byte is a field's (no implicit padding), which the `DeviceRepr` below relies on: the
// twelve words before `flags_calls` (`timed_out` and `pad` one), the call counts, the partials.
const _: () = assert!(
    std::mem::size_of::<KernelState>()
        == 12 * 8 + (FLAGS_MAX_CTAS + MAX_CTAS) as usize * 8 + 3 * SPLIT_ROWS * NORM_CHUNKS * 4
);

// SAFETY: the kernels' `State` as plain data: `#[repr(C)]`, integers and floats only (the
// device pointer held as a u64), no implicit padding (asserted above), so every byte copied
// to the device is initialised and means there what it means here; the tests check the
// layout against the compiled kernels'.
unsafe impl DeviceRepr for KernelState {}

impl KernelState {
    /// A new instance's state: no call made, nothing given up, `gave_up` the device address
    /// of the instance's host-mapped word, the norm partials sentinels.
    pub(super) fn new(gave_up: u64) -> Self {
        Self {
            unused0: [0; 2],
            flags_bytes: [0; 3],
            unused1: 0,
            timed_out: 0,
            pad: 0,
            gave_up,
            partial_floats: [0; 3],
            unused2: 0,
            flags_calls: [0; FLAGS_MAX_CTAS as usize],
            barrier_calls: [0; MAX_CTAS as usize],
            partials: [[-0.0; SPLIT_ROWS * NORM_CHUNKS]; 3],
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// The symbol `allreduce.cu` exports its `State`'s layout under.
    const TABLE: &str = "nccl_rs_allreduce_state_layout";

    /// What the table holds, as the host has it, in the table's order.
    fn host_layout() -> [u64; 12] {
        [
            size_of::<KernelState>(),
            offset_of!(KernelState, flags_bytes),
            offset_of!(KernelState, timed_out),
            offset_of!(KernelState, gave_up),
            offset_of!(KernelState, partial_floats),
            offset_of!(KernelState, flags_calls),
            offset_of!(KernelState, barrier_calls),
            offset_of!(KernelState, partials),
            FLAGS_MAX_CTAS as usize,
            MAX_CTAS as usize,
            SPLIT_ROWS,
            NORM_CHUNKS,
        ]
        .map(|n| n as u64)
    }

    /// The initializer of the global `name` in `ptx`, as u64s: nvcc writes it as `.b8`
    /// bytes (little-endian, the trailing zero bytes left out) or as `.u64`/`.b64` words.
    fn ptx_global(ptx: &str, name: &str) -> Vec<u64> {
        let decl = format!(" {name}[");
        let line = ptx
            .lines()
            .find(|l| l.starts_with('.') && l.contains(&decl))
            .unwrap_or_else(|| panic!("{name} is not in the PTX"));
        let inside = |open: char, close: char| {
            let from = line.find(open).unwrap() + 1;
            &line[from..from + line[from..].find(close).unwrap()]
        };
        let len: usize = inside('[', ']').parse().unwrap();
        let values = inside('{', '}')
            .split(',')
            .map(|v| v.trim().parse::<u64>().unwrap());
        if line.contains(".b8 ") {
            let mut bytes: Vec<u8> = values.map(|b| u8::try_from(b).unwrap()).collect();
            bytes.resize(len, 0);
            bytes
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                .collect()
        } else {
            assert!(line.contains(".u64 ") || line.contains(".b64 "), "{line}");
            let mut words: Vec<u64> = values.collect();
            words.resize(len, 0);
            words
        }
    }

    /// The bytes the symbol `name` of the ELF64 `elf` (a cubin) is initialised with: its
    /// section's data at the symbol's value, for the symbol's size.
    fn cubin_symbol<'a>(elf: &'a [u8], name: &str) -> &'a [u8] {
        let u16_at = |at: usize| u16::from_le_bytes(elf[at..at + 2].try_into().unwrap()) as usize;
        let u32_at = |at: usize| u32::from_le_bytes(elf[at..at + 4].try_into().unwrap()) as usize;
        let u64_at = |at: usize| u64::from_le_bytes(elf[at..at + 8].try_into().unwrap()) as usize;
        let (sections, entry, count) = (u64_at(0x28), u16_at(0x3a), u16_at(0x3c));
        // (type, offset, size, link) of section i.
        let section = |i: usize| {
            let at = sections + i * entry;
            (
                u32_at(at + 4),
                u64_at(at + 24),
                u64_at(at + 32),
                u32_at(at + 40),
            )
        };
        let c_str = |at: usize| {
            let end = at + elf[at..].iter().position(|&b| b == 0).unwrap();
            &elf[at..end]
        };
        const SYMTAB: usize = 2;
        let (_, symbols, size, link) = (0..count)
            .map(section)
            .find(|s| s.0 == SYMTAB)
            .expect("the cubin has a symbol table");
        let (_, names, _, _) = section(link);
        for symbol in (symbols..symbols + size).step_by(24) {
            if c_str(names + u32_at(symbol)) == name.as_bytes() {
                let (_, data, _, _) = section(u16_at(symbol + 6));
                let from = data + u64_at(symbol + 8);
                return &elf[from..from + u64_at(symbol + 16)];
            }
        }
        panic!("{name} is not in the cubin");
    }

    #[test]
    fn the_state_is_the_compiled_kernels() {
        let host = host_layout();
        let ptx = include_str!("../shipped/allreduce.compute_80.ptx");
        assert_eq!(ptx_global(ptx, TABLE), host, "the PTX's State");
        let cubin = include_bytes!("../shipped/allreduce.sm_90.cubin");
        let table: Vec<u64> = cubin_symbol(cubin, TABLE)
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        assert_eq!(table, host, "the cubin's State");
    }

    #[test]
    fn a_new_state_is_zero_but_gave_up_and_the_sentinels() {
        let state = KernelState::new(0x7f00_1234_5678);
        assert_eq!(state.gave_up, 0x7f00_1234_5678);
        assert_eq!(state.timed_out, 0);
        assert!(state
            .flags_calls
            .iter()
            .chain(&state.barrier_calls)
            .all(|&c| c == 0));
        assert!(state
            .partials
            .iter()
            .flatten()
            .all(|p| p.to_bits() == 0x8000_0000));
    }
}
