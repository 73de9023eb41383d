//! The rules of the v-collectives and their expansion into NCCL calls, as pure functions of
//! one rank's arguments: no communicator or GPU is needed to test them.
//!
//! Here: the words of the rules ([`Step`], [`Seg`], [`Args`], [`Broken`]), which
//! [`Construction`] builds each collective, the layout checks, and what each rank sends to
//! and expects from every other (for the checked mode). `plan.rs` checks one rank's
//! arguments with them and returns the [`Step`]s (one NCCL call each) that carry the
//! operation out on this rank. A broken rule comes back as a small [`Broken`], which becomes
//! a message only when it happens. The tests of both are in `rules/tests.rs`.

use super::layout::Layout;
use crate::error::Error;

/// Which NCCL calls a v-collective is built from. Every rank must choose the same.
///
/// Only [`VOperation::all_gather_v`](super::VOperation::all_gather_v) has two: grouped
/// sends and receives (the default: faster on NVLink, measured in the
/// [module docs](super)) or grouped broadcasts (one per root; NCCL 2.29 recognises that
/// pattern, and a broadcast's ring spares a root's links). The
/// others have one each (grouped sends and receives; one reduce per root for
/// reduce-scatter); asking for one they do not have is an
/// [`InvalidArgument`](crate::Error::InvalidArgument). The choice exists so the bench can
/// compare them on real hardware.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Construction {
    /// The collective's default construction.
    #[default]
    Auto,
    /// One NCCL collective per root, grouped: broadcasts (all-gather) or reduces
    /// (reduce-scatter).
    Collective,
    /// Grouped `ncclSend`/`ncclRecv`, one pair per pair of ranks with data to move.
    PointToPoint,
}

/// Which v-collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VKind {
    AllToAll,
    AllGather,
    ReduceScatter,
    Gather { root: usize },
    Scatter { root: usize },
}

impl VKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            VKind::AllToAll => "all_to_all_v",
            VKind::AllGather => "all_gather_v",
            VKind::ReduceScatter => "reduce_scatter_v",
            VKind::Gather { .. } => "gather_v",
            VKind::Scatter { .. } => "scatter_v",
        }
    }

    /// A number that differs between kinds and roots (for the checked mode's comparison).
    pub(crate) fn code(self) -> u64 {
        let (kind, root) = match self {
            VKind::AllToAll => (1, 0),
            VKind::AllGather => (2, 0),
            VKind::ReduceScatter => (3, 0),
            VKind::Gather { root } => (4, root),
            VKind::Scatter { root } => (5, root),
        };
        kind | (root as u64) << 8
    }
}

/// How a v-collective is built from NCCL calls, once `Auto` is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Built {
    /// One broadcast (all-gather) or reduce (reduce-scatter) per root, grouped.
    Collective,
    /// Grouped sends and receives.
    PointToPoint,
}

/// Which buffer a segment lies in (in place: the receive buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Buf {
    Send,
    Recv,
}

/// `count` elements at element `offset` of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    pub(crate) buf: Buf,
    pub(crate) offset: usize,
    pub(crate) count: usize,
}

/// One NCCL call of an expanded v-collective. Zero-count transfers are never planned: both
/// sides of a pair skip together when the counts agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    Send {
        peer: usize,
        from: Seg,
    },
    Recv {
        peer: usize,
        into: Seg,
    },
    /// `send` is the root's source (`Some` only on the root; equal to `recv` in place).
    Broadcast {
        root: usize,
        send: Option<Seg>,
        recv: Seg,
    },
    /// `recv` is the root's destination (`Some` only on the root; equal to `send` in place).
    Reduce {
        root: usize,
        send: Seg,
        recv: Option<Seg>,
    },
}

/// One rank's arguments: buffer lengths and layouts. In place, the single buffer is the
/// receive buffer and its layout sits where the operation's layout naturally goes (receive
/// for all-gather and gather, send for reduce-scatter and scatter).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Args<'l> {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) send_len: Option<usize>,
    pub(crate) send_layout: Option<&'l Layout>,
    pub(crate) recv_len: Option<usize>,
    pub(crate) recv_layout: Option<&'l Layout>,
    pub(crate) in_place: bool,
}

/// Which rule a v-collective breaks. Small and free of text; [`Broken::to_error`] writes
/// the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Broken {
    /// A buffer or layout the operation needs on this rank is missing.
    Missing(&'static str),
    /// The root is not a rank of the communicator.
    RootOutOfRange(usize),
    /// A layout's counts or displacements do not have one entry per rank.
    Entries {
        layout: &'static str,
        what: &'static str,
        len: usize,
    },
    /// A segment does not lie inside its buffer.
    Outside {
        layout: &'static str,
        peer: usize,
        displ: usize,
        count: usize,
        len: usize,
    },
    /// Two written segments overlap.
    Overlap {
        layout: &'static str,
        first: usize,
        second: usize,
    },
    /// This rank's own contribution and its segment in the layout differ in length.
    OwnCount {
        buffer: &'static str,
        len: usize,
        count: usize,
    },
    /// All-to-all was asked for in place.
    InPlaceAllToAll,
    /// The construction asked for does not exist for this collective.
    NoConstruction(Construction),
}

impl Broken {
    #[cold]
    #[inline(never)]
    pub(crate) fn to_error(self, kind: VKind, rank: usize, size: usize) -> Error {
        let name = kind.name();
        let message = match self {
            Broken::Missing(what) => format!("{name} on rank {rank} needs a {what}"),
            Broken::RootOutOfRange(root) => {
                format!("{name}: root {root} is out of range for a communicator of {size} ranks")
            }
            Broken::Entries { layout, what, len } => format!(
                "{name} on rank {rank}: the {layout} layout has {len} {what}, but the \
                 communicator has {size} ranks (one entry per rank is needed)"
            ),
            Broken::Outside {
                layout,
                peer,
                displ,
                count,
                len,
            } => format!(
                "{name} on rank {rank}: the {layout} segment for rank {peer} ({count} elements \
                 at element {displ}) does not lie inside the {layout} buffer of {len} elements"
            ),
            Broken::Overlap {
                layout,
                first,
                second,
            } => format!(
                "{name} on rank {rank}: the {layout} segments for ranks {first} and {second} \
                 overlap (the writes into them would corrupt each other silently)"
            ),
            Broken::OwnCount { buffer, len, count } => format!(
                "{name} on rank {rank}: the {buffer} buffer has {len} elements, but the layout \
                 gives rank {rank}'s own segment {count}"
            ),
            Broken::InPlaceAllToAll => {
                format!("{name} has no in-place form (every rank reads and writes all segments)")
            }
            Broken::NoConstruction(construction) => {
                format!("{name} has no {construction:?} construction")
            }
        };
        Error::invalid(message)
    }
}

/// Settles `Auto` and refuses constructions a collective does not have.
pub(crate) fn built(kind: VKind, construction: Construction) -> Result<Built, Broken> {
    match (kind, construction) {
        // Measured (module docs): grouped send/receive beat grouped broadcasts for
        // all-gather-v on NVLink, so it is the default; the broadcasts stay on request.
        (VKind::AllGather, Construction::Collective) => Ok(Built::Collective),
        (VKind::ReduceScatter, Construction::Auto | Construction::Collective) => {
            Ok(Built::Collective)
        }
        (VKind::ReduceScatter, Construction::PointToPoint) => {
            Err(Broken::NoConstruction(construction))
        }
        (_, Construction::Auto | Construction::PointToPoint) => Ok(Built::PointToPoint),
        (_, Construction::Collective) => Err(Broken::NoConstruction(construction)),
    }
}

/// One count and one displacement per rank, and every segment inside a buffer of `len`
/// elements (zero-count segments too: a displacement past the end is a bug in whoever
/// computed it). The end of a segment is computed without overflow, so this also keeps every
/// count and byte offset within NCCL's `size_t`.
pub(crate) fn check_layout(
    layout: &Layout,
    name: &'static str,
    size: usize,
    len: usize,
) -> Result<(), Broken> {
    let entries = |what, got: usize| {
        if got == size {
            Ok(())
        } else {
            Err(Broken::Entries {
                layout: name,
                what,
                len: got,
            })
        }
    };
    entries("counts", layout.counts().len())?;
    entries("displacements", layout.displs().len())?;
    for (peer, (&count, &displ)) in layout.counts().iter().zip(layout.displs()).enumerate() {
        if displ.checked_add(count).is_none_or(|end| end > len) {
            return Err(Broken::Outside {
                layout: name,
                peer,
                displ,
                count,
                len,
            });
        }
    }
    Ok(())
}

/// No two non-empty segments share an element. Call after [`check_layout`].
pub(crate) fn check_disjoint(layout: &Layout, name: &'static str) -> Result<(), Broken> {
    let (counts, displs) = (layout.counts(), layout.displs());
    // Already in order when packed (the usual case): no sort, no allocation.
    let ordered = (1..counts.len()).all(|i| displs[i - 1] <= displs[i]);
    let mut order: Vec<usize>;
    let order: &mut dyn Iterator<Item = usize> = if ordered {
        &mut (0..counts.len())
    } else {
        order = (0..counts.len()).collect();
        order.sort_by_key(|&i| displs[i]);
        &mut order.into_iter()
    };
    // The non-empty segment that ends furthest so far.
    let mut reach: Option<(usize, usize)> = None;
    for i in order.filter(|&i| counts[i] > 0) {
        if let Some((first, end)) = reach {
            if displs[i] < end {
                let (first, second) = (first.min(i), first.max(i));
                return Err(Broken::Overlap {
                    layout: name,
                    first,
                    second,
                });
            }
        }
        let end = displs[i] + counts[i];
        if reach.is_none_or(|(_, far)| end > far) {
            reach = Some((i, end));
        }
    }
    Ok(())
}

/// What this rank sends to and expects from every rank, once `plan` accepted its
/// arguments: `(sends, recvs)`, `size` entries each. The ranks agree when rank `i`'s
/// `sends[j]` equals rank `j`'s `recvs[i]` for every pair; the checked mode compares them.
pub(crate) fn pair_counts(kind: VKind, args: &Args<'_>) -> (Vec<u64>, Vec<u64>) {
    let Args {
        rank,
        size,
        in_place,
        ..
    } = *args;
    let count = |c: usize| c as u64;
    let counts = |layout: Option<&Layout>| -> Vec<u64> {
        layout.map_or_else(
            || vec![0; size],
            |l| l.counts().iter().map(|&c| c as u64).collect(),
        )
    };
    let own_of = |layout: Option<&Layout>| layout.map_or(0, |l| count(l.counts()[rank]));
    let mut sends = vec![0; size];
    let mut recvs = vec![0; size];
    match kind {
        VKind::AllToAll => {
            sends = counts(args.send_layout);
            recvs = counts(args.recv_layout);
        }
        VKind::AllGather => {
            sends = vec![own_of(args.recv_layout); size];
            recvs = counts(args.recv_layout);
        }
        VKind::ReduceScatter => {
            sends = counts(args.send_layout);
            recvs = vec![own_of(args.send_layout); size];
        }
        VKind::Gather { root } if rank == root => {
            sends[root] = own_of(args.recv_layout);
            recvs = counts(args.recv_layout);
        }
        VKind::Gather { root } => {
            let len = if in_place {
                args.recv_len
            } else {
                args.send_len
            };
            sends[root] = count(len.unwrap_or(0));
        }
        VKind::Scatter { root } if rank == root => {
            sends = counts(args.send_layout);
            recvs[root] = own_of(args.send_layout);
        }
        VKind::Scatter { root } => recvs[root] = count(args.recv_len.unwrap_or(0)),
    }
    (sends, recvs)
}

#[cfg(test)]
mod tests;
