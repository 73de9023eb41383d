//! The split matrices of the variable-size collectives (`--splits even|zipf:S`): who sends
//! how many elements to whom, the same on every rank (a pure function of the flags and the
//! seed), and what it means for the bus bandwidth.
//!
//! `benches/torch_all_to_all_single.py` ports [`split`] line by line, so torch's
//! `all_to_all_single` runs on the same matrix; both sides assert the rows of
//! [`tests::rows_match_the_python_port`].

use std::fmt;

/// How a total is split over the ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Splits {
    /// Equal parts (the first `total % n` parts one element more).
    Even,
    /// Part sizes proportional to `1 / k^s`, `k` = 1..=n being a destination's popularity in
    /// the sender's own (seeded) order: mixture-of-experts routing with a few hot experts.
    Zipf(f64),
}

impl Splits {
    /// Parses `even` or `zipf:S` (S a finite exponent ≥ 0, e.g. `zipf:1.1`).
    pub fn parse(text: &str) -> Result<Splits, String> {
        let lower = text.trim().to_ascii_lowercase();
        if lower == "even" {
            return Ok(Splits::Even);
        }
        let bad =
            || format!("--splits: expected even or zipf:S (S >= 0, e.g. zipf:1.1), got {text:?}");
        let exponent: f64 = lower
            .strip_prefix("zipf:")
            .ok_or_else(bad)?
            .parse()
            .map_err(|_| bad())?;
        if !exponent.is_finite() || exponent < 0.0 {
            return Err(bad());
        }
        Ok(Splits::Zipf(exponent))
    }
}

impl fmt::Display for Splits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Splits::Even => write!(f, "even"),
            Splits::Zipf(s) => write!(f, "zipf:{s}"),
        }
    }
}

/// The seed used unless `--seed` says otherwise.
pub const DEFAULT_SEED: u64 = 1;

/// splitmix64: the whole random source (trivial to port exactly; Python does it with masks).
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Row `row`'s split of `total` elements into `n` parts. Exact: the parts always sum to
/// `total`.
///
/// Zipf: the destinations are shuffled (Fisher–Yates, splitmix64 seeded with
/// `seed ^ (row + 1) * 0xd1b54a32d192ed03`); the k-th of them (k from 0) gets the integer
/// weight `floor(2^32 / (k + 1)^s)` (the C library's `pow`, the only floating-point step,
/// which Python's `**` calls too); part j is `floor(total * w_j / W)` (W the sum of the
/// weights, in 128-bit integers), and the elements left over go one each to the parts with
/// the largest remainders `total * w_j mod W`, lower j first on ties.
pub fn split(splits: Splits, total: usize, n: usize, seed: u64, row: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let exponent = match splits {
        Splits::Even => {
            return (0..n)
                .map(|j| total / n + usize::from(j < total % n))
                .collect()
        }
        Splits::Zipf(s) => s,
    };
    let mut state = seed ^ (row as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next(&mut state) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut weights = vec![0u128; n];
    for (k, &dest) in order.iter().enumerate() {
        weights[dest] = (4_294_967_296.0 / ((k + 1) as f64).powf(exponent)).floor() as u128;
    }
    // The most popular destination weighs 2^32, so the sum is never 0.
    let sum: u128 = weights.iter().sum();
    let total_wide = total as u128;
    let mut parts: Vec<usize> = weights
        .iter()
        .map(|&w| (total_wide * w / sum) as usize)
        .collect();
    let left = total - parts.iter().sum::<usize>();
    let mut by_remainder: Vec<usize> = (0..n).collect();
    by_remainder.sort_by_key(|&j| (std::cmp::Reverse(total_wide * weights[j] % sum), j));
    for &j in &by_remainder[..left] {
        parts[j] += 1;
    }
    parts
}

/// Which v-collective a [`VShape`] describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VKind {
    /// Row i of the matrix: what rank i sends to each rank.
    AllToAll,
    /// One row: every rank's contribution (its segment of the gathered buffer).
    AllGather,
    /// One row: every rank's segment of the reduced buffer.
    ReduceScatter,
}

/// The counts of one v-collective at one size, for every rank, and this rank's layouts.
#[derive(Debug, Clone)]
pub struct VShape {
    /// The operation.
    pub kind: VKind,
    /// All-to-all: `matrix[i][j]` elements go from rank i to rank j. All-gather and
    /// reduce-scatter: one row, rank j's segment (`matrix[0][j]`).
    pub matrix: Vec<Vec<usize>>,
    /// This rank's send layout (all-to-all: its row; reduce-scatter: the segments of the
    /// send buffer, the in-place buffer's too); packed.
    pub send: nccl::Layout,
    /// This rank's receive layout (all-to-all: its column; all-gather: the segments of the
    /// receive buffer, the in-place buffer's too); packed.
    pub recv: nccl::Layout,
    /// Elements the busiest rank moves over its links in one direction (see
    /// [`VShape::new`]).
    pub bus_elems: usize,
}

impl VShape {
    /// The counts for `total` elements (all-to-all: each rank's send buffer; all-gather: the
    /// receive buffer; reduce-scatter: the send buffer) over `n` ranks, as seen by `rank`.
    ///
    /// Bus bandwidth, from the bytes actually moved: `bus_elems` is the most elements any
    /// one rank must send to or receive from the other ranks (its own segment stays on the
    /// GPU). All-to-all: max over ranks r of max(Σ_{j≠r} M[r][j], Σ_{i≠r} M[i][r]).
    /// All-gather and reduce-scatter: max over r of (total − c_r): what rank r receives
    /// (all-gather), or sends towards the other roots (reduce-scatter, one reduce per
    /// root). With even splits this is total × (n−1)/n, nccl-tests' busbw of the fixed-size
    /// collective, so `alltoall` and `all_to_all_v --splits even` print the same figure.
    pub fn new(
        kind: VKind,
        splits: Splits,
        total: usize,
        n: usize,
        rank: usize,
        seed: u64,
    ) -> Self {
        let rows = if kind == VKind::AllToAll { n } else { 1 };
        let matrix: Vec<Vec<usize>> = (0..rows)
            .map(|row| split(splits, total, n, seed, row))
            .collect();
        let column = |r: usize| -> Vec<usize> { matrix.iter().map(|row| row[r]).collect() };
        let (send, recv, bus_elems) = match kind {
            VKind::AllToAll => {
                let busiest = (0..n)
                    .map(|r| {
                        let sent = matrix[r].iter().sum::<usize>() - matrix[r][r];
                        let received = column(r).iter().sum::<usize>() - matrix[r][r];
                        sent.max(received)
                    })
                    .max()
                    .unwrap_or(0);
                (matrix[rank].clone(), column(rank), busiest)
            }
            VKind::AllGather | VKind::ReduceScatter => {
                let row = &matrix[0];
                let busiest = row.iter().map(|c| total - c).max().unwrap_or(0);
                (row.clone(), row.clone(), busiest)
            }
        };
        VShape {
            kind,
            send: nccl::Layout::packed(send),
            recv: nccl::Layout::packed(recv),
            matrix,
            bus_elems,
        }
    }

    /// Where element `i` of the receive layout's buffer comes from: `(rank, element of its
    /// segment)`, or `None` in a gap (there are none in packed layouts) or past the end.
    pub fn source(&self, layout: &nccl::Layout, i: usize) -> Option<(usize, usize)> {
        let peer = layout
            .displs()
            .partition_point(|&d| d <= i)
            .checked_sub(1)?;
        // Skip empty segments that start at the same place.
        (0..=peer).rev().find_map(|p| {
            layout
                .segment(p)
                .filter(|s| s.contains(&i))
                .map(|s| (p, i - s.start))
        })
    }

    /// Where rank `from`'s segment for rank `to` starts in `from`'s send buffer (all-to-all).
    pub fn send_displ(&self, from: usize, to: usize) -> usize {
        self.matrix[from][..to].iter().sum()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The rows `benches/torch_all_to_all_single.py` asserts as well (its `EXPECTED`): a
    /// change here must be made there too, or the two stop measuring the same matrix.
    pub const EXPECTED: [(&str, usize, usize, u64, usize, &[usize]); 5] = [
        ("zipf:1.1", 1000, 4, 1, 0, &[151, 504, 235, 110]),
        ("zipf:1.1", 1000, 4, 1, 3, &[110, 235, 151, 504]),
        (
            "zipf:2",
            1_048_576,
            4,
            7,
            1,
            &[736561, 184140, 46035, 81840],
        ),
        (
            "zipf:1.1",
            8_388_608,
            8,
            1,
            5,
            &[
                339119, 1558184, 3340040, 568702, 997513, 392775, 465356, 726919,
            ],
        ),
        ("even", 10, 4, 1, 2, &[3, 3, 2, 2]),
    ];

    #[test]
    fn rows_match_the_python_port() {
        for (splits, total, n, seed, row, want) in EXPECTED {
            let got = split(Splits::parse(splits).unwrap(), total, n, seed, row);
            println!("{splits} total {total} n {n} seed {seed} row {row}: {got:?}");
            assert_eq!(got, want, "{splits} total {total} seed {seed} row {row}");
        }
    }

    #[test]
    fn every_row_sums_to_its_total_exactly() {
        for splits in [
            Splits::Even,
            Splits::Zipf(0.0),
            Splits::Zipf(1.1),
            Splits::Zipf(3.0),
        ] {
            for n in [1, 2, 3, 8, 17] {
                for total in [0, 1, 7, 1000, (1 << 30) + 3] {
                    for row in 0..n {
                        let parts = split(splits, total, n, 42, row);
                        assert_eq!(parts.len(), n);
                        assert_eq!(parts.iter().sum::<usize>(), total, "{splits} {n} {total}");
                    }
                }
            }
        }
        // Zipf with exponent 0 is even, up to where the remainder goes.
        let flat = split(Splits::Zipf(0.0), 1000, 4, 9, 0);
        assert!(flat.iter().all(|&p| p == 250), "{flat:?}");
    }

    #[test]
    fn zipf_is_skewed_and_rows_differ() {
        let a = split(Splits::Zipf(1.1), 1 << 20, 8, 1, 0);
        let b = split(Splits::Zipf(1.1), 1 << 20, 8, 1, 1);
        assert_ne!(a, b);
        let (max, min) = (*a.iter().max().unwrap(), *a.iter().min().unwrap());
        assert!(max > 5 * min, "{a:?}");
        assert_ne!(
            split(Splits::Zipf(1.1), 1 << 20, 8, 2, 0),
            a,
            "the seed matters"
        );
    }

    #[test]
    fn parse_accepts_even_and_zipf_only() {
        assert_eq!(Splits::parse("even"), Ok(Splits::Even));
        assert_eq!(Splits::parse("ZIPF:1.1"), Ok(Splits::Zipf(1.1)));
        for bad in [
            "zipf", "zipf:", "zipf:-1", "zipf:nan", "zipf:inf", "uniform", "",
        ] {
            assert!(Splits::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Splits::Zipf(1.1).to_string(), "zipf:1.1");
    }

    #[test]
    fn even_bus_bytes_are_nccl_tests_ones() {
        // 4 ranks, 64 elements per rank: (n-1)/n of the total, as alltoall, all_gather and
        // reduce_scatter count it.
        for kind in [VKind::AllToAll, VKind::AllGather, VKind::ReduceScatter] {
            let shape = VShape::new(kind, Splits::Even, 64, 4, 1, 1);
            assert_eq!(shape.bus_elems, 48, "{kind:?}");
        }
        let a2a = VShape::new(VKind::AllToAll, Splits::Even, 64, 4, 1, 1);
        assert_eq!(a2a.send.counts(), &[16; 4]);
        assert_eq!(a2a.recv.counts(), &[16; 4]);
    }

    #[test]
    fn zipf_all_to_all_layouts_are_row_and_column() {
        let n = 3;
        let shapes: Vec<VShape> = (0..n)
            .map(|r| VShape::new(VKind::AllToAll, Splits::Zipf(1.5), 300, n, r, 5))
            .collect();
        let m = &shapes[0].matrix;
        for (r, shape) in shapes.iter().enumerate() {
            assert_eq!(&shape.matrix, m, "every rank computes the same matrix");
            assert_eq!(shape.send.counts(), &m[r][..]);
            let column: Vec<usize> = m.iter().map(|row| row[r]).collect();
            assert_eq!(shape.recv.counts(), &column[..]);
        }
        let busiest = (0..n)
            .map(|r| {
                let off = |v: usize| v - m[r][r];
                off(m[r].iter().sum()).max(off(m.iter().map(|row| row[r]).sum()))
            })
            .max()
            .unwrap();
        assert_eq!(shapes[0].bus_elems, busiest);
        // Receive element -> (source rank, element of its segment).
        let recv = &shapes[1].recv;
        let (first, second) = (recv.counts()[0], recv.counts()[1]);
        assert_eq!(shapes[1].source(recv, 0), (first > 0).then_some((0, 0)));
        if second > 0 {
            assert_eq!(shapes[1].source(recv, first), Some((1, 0)));
        }
        assert_eq!(shapes[1].source(recv, recv.total()), None);
        assert_eq!(shapes[0].send_displ(2, 1), m[2][0]);
    }

    #[test]
    fn gather_and_scatter_bus_bytes_follow_the_smallest_segment() {
        let shape = VShape::new(VKind::AllGather, Splits::Zipf(1.1), 1000, 4, 0, 1);
        let smallest = *shape.matrix[0].iter().min().unwrap();
        assert_eq!(shape.bus_elems, 1000 - smallest);
        assert_eq!(shape.recv.total(), 1000);
    }
}
