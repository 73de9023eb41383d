//! The expansion of a v-collective into NCCL calls: [`plan`] checks one rank's arguments
//! against the rules (`rules.rs`) and returns the [`Step`]s, one NCCL call each, that carry
//! the operation out on this rank. One function per collective, each reading as what it
//! checks and then which calls it plans; pure functions, tested in `rules/tests.rs`.

use super::layout::Layout;
use super::rules::{check_disjoint, check_layout, Args, Broken, Buf, Built, Seg, Step, VKind};

/// Checks one rank's arguments and expands the operation into its NCCL calls on this rank.
///
/// What cannot be checked here is that the ranks agree: rank `i`'s count for `j` must equal
/// rank `j`'s count for `i` (see the checked mode).
pub(crate) fn plan(kind: VKind, built: Built, args: &Args<'_>) -> Result<Vec<Step>, Broken> {
    let mut steps = Vec::new();
    match kind {
        VKind::AllToAll => plan_all_to_all(args, &mut steps)?,
        VKind::AllGather => plan_all_gather(args, built, &mut steps)?,
        VKind::ReduceScatter => plan_reduce_scatter(args, &mut steps)?,
        VKind::Gather { root } => plan_gather(args, root, &mut steps)?,
        VKind::Scatter { root } => plan_scatter(args, root, &mut steps)?,
    }
    Ok(steps)
}

/// All-to-all-v: a send of each non-empty send segment, a receive into each non-empty
/// receive segment (written, so disjoint).
fn plan_all_to_all(args: &Args<'_>, steps: &mut Vec<Step>) -> Result<(), Broken> {
    if args.in_place {
        return Err(Broken::InPlaceAllToAll);
    }
    let send = args.laid(Side::Input, false)?;
    let recv = args.laid(Side::Output, false)?;
    send.check_read(args.size)?;
    recv.check_written(args.size)?;
    for peer in 0..args.size {
        if send.count(peer) > 0 {
            let from = seg(Buf::Send, send.layout, peer);
            steps.push(Step::Send { peer, from });
        }
        if recv.count(peer) > 0 {
            let into = seg(Buf::Recv, recv.layout, peer);
            steps.push(Step::Recv { peer, into });
        }
    }
    Ok(())
}

/// All-gather-v: this rank's contribution (its own segment in place, else the whole send
/// buffer, which must fill it) goes to every rank: a broadcast per non-empty root, or a
/// send to and a receive from each peer.
fn plan_all_gather(args: &Args<'_>, built: Built, steps: &mut Vec<Step>) -> Result<(), Broken> {
    let Args { rank, in_place, .. } = *args;
    let recv = args.laid(Side::Output, false)?;
    recv.check_written(args.size)?;
    let own = if in_place {
        seg(Buf::Recv, recv.layout, rank)
    } else {
        let s = need(args.send_len, "send buffer")?;
        check_own_count("send", s, recv.count(rank))?;
        whole(Buf::Send, s)
    };
    for peer in 0..args.size {
        let count = recv.count(peer);
        match built {
            Built::Collective if count > 0 => steps.push(Step::Broadcast {
                root: peer,
                send: (peer == rank).then_some(own),
                recv: seg(Buf::Recv, recv.layout, peer),
            }),
            Built::Collective => {}
            Built::PointToPoint => {
                if peer == rank && in_place {
                    continue;
                }
                if own.count > 0 {
                    steps.push(Step::Send { peer, from: own });
                }
                if count > 0 {
                    let into = seg(Buf::Recv, recv.layout, peer);
                    steps.push(Step::Recv { peer, into });
                }
            }
        }
    }
    Ok(())
}

/// Reduce-scatter-v: one reduce per non-empty segment, rooted at the segment's rank, whose
/// result lands in its receive buffer (in place, in the segment itself).
fn plan_reduce_scatter(args: &Args<'_>, steps: &mut Vec<Step>) -> Result<(), Broken> {
    let Args { rank, in_place, .. } = *args;
    let send = args.laid(Side::Input, false)?;
    if in_place {
        // This rank's segment is written while the others are read.
        send.check_written(args.size)?;
    } else {
        send.check_read(args.size)?;
        let r = need(args.recv_len, "receive buffer")?;
        check_own_count("receive", r, send.count(rank))?;
    }
    for root in 0..args.size {
        if send.count(root) == 0 {
            continue;
        }
        let from = seg(args.input_buf(), send.layout, root);
        let into = (root == rank).then(|| {
            if in_place {
                from
            } else {
                whole(Buf::Recv, from.count)
            }
        });
        steps.push(Step::Reduce {
            root,
            send: from,
            recv: into,
        });
    }
    Ok(())
}

/// Gather-v: off the root, one send of the whole buffer; on the root, a receive into each
/// non-empty segment (written, so disjoint), its own by a send to itself unless in place.
fn plan_gather(args: &Args<'_>, root: usize, steps: &mut Vec<Step>) -> Result<(), Broken> {
    let Args { rank, in_place, .. } = *args;
    check_root(root, args.size)?;
    if rank != root {
        // Off the root the whole buffer is sent; a receive buffer or layout given here is
        // not used.
        let len = need(
            if in_place {
                args.recv_len
            } else {
                args.send_len
            },
            "send buffer",
        )?;
        if len > 0 {
            steps.push(Step::Send {
                peer: root,
                from: whole(args.input_buf(), len),
            });
        }
        return Ok(());
    }
    let recv = args.laid(Side::Output, true)?;
    recv.check_written(args.size)?;
    if !in_place {
        check_own_count(
            "send",
            need(args.send_len, "send buffer")?,
            recv.count(root),
        )?;
    }
    for peer in 0..args.size {
        let count = recv.count(peer);
        if count == 0 || (peer == root && in_place) {
            continue;
        }
        if peer == root {
            let from = whole(Buf::Send, count);
            steps.push(Step::Send { peer, from });
        }
        let into = seg(Buf::Recv, recv.layout, peer);
        steps.push(Step::Recv { peer, into });
    }
    Ok(())
}

/// Scatter-v: off the root, one receive into the whole buffer; on the root, a send of each
/// non-empty segment (only read, so they may overlap), its own to itself unless in place.
fn plan_scatter(args: &Args<'_>, root: usize, steps: &mut Vec<Step>) -> Result<(), Broken> {
    let Args { rank, in_place, .. } = *args;
    check_root(root, args.size)?;
    if rank != root {
        let what = if in_place {
            "in-place buffer"
        } else {
            "receive buffer"
        };
        let len = need(args.recv_len, what)?;
        if len > 0 {
            steps.push(Step::Recv {
                peer: root,
                into: whole(Buf::Recv, len),
            });
        }
        return Ok(());
    }
    let send = args.laid(Side::Input, true)?;
    send.check_read(args.size)?;
    if !in_place {
        let r = need(args.recv_len, "receive buffer")?;
        check_own_count("receive", r, send.count(root))?;
    }
    for peer in 0..args.size {
        let count = send.count(peer);
        if count == 0 || (peer == root && in_place) {
            continue;
        }
        steps.push(Step::Send {
            peer,
            from: seg(args.input_buf(), send.layout, peer),
        });
        if peer == root {
            let into = whole(Buf::Recv, count);
            steps.push(Step::Recv { peer, into });
        }
    }
    Ok(())
}

fn need<T>(value: Option<T>, what: &'static str) -> Result<T, Broken> {
    value.ok_or(Broken::Missing(what))
}

/// The root is a rank of the communicator.
fn check_root(root: usize, size: usize) -> Result<(), Broken> {
    if root < size {
        Ok(())
    } else {
        Err(Broken::RootOutOfRange(root))
    }
}

/// This rank's own contribution (`len` elements of `buffer`) fills its segment (`count`).
fn check_own_count(buffer: &'static str, len: usize, count: usize) -> Result<(), Broken> {
    if len == count {
        Ok(())
    } else {
        Err(Broken::OwnCount { buffer, len, count })
    }
}

/// Peer `peer`'s segment of a buffer laid out by `layout`.
fn seg(buf: Buf, layout: &Layout, peer: usize) -> Seg {
    Seg {
        buf,
        offset: layout.displs()[peer],
        count: layout.counts()[peer],
    }
}

/// The first `count` elements of a buffer: a whole contribution.
fn whole(buf: Buf, count: usize) -> Seg {
    Seg {
        buf,
        offset: 0,
        count,
    }
}

/// Which side of a v-collective a laid-out buffer is on: read (`Input`: the send buffer,
/// in place the single buffer) or written (`Output`: the receive buffer, in place the same).
#[derive(Clone, Copy)]
enum Side {
    Input,
    Output,
}

/// A buffer whose segments the layout places, with its length and the name it is reported
/// by.
struct Laid<'l> {
    len: usize,
    layout: &'l Layout,
    name: &'static str,
}

impl<'l> Args<'l> {
    /// The laid-out buffer on `side` with its layout, each required (named as missing, with
    /// "(root)" where only the root needs them).
    fn laid(&self, side: Side, on_root: bool) -> Result<Laid<'l>, Broken> {
        let (buffer, layout) = match (side, self.in_place, on_root) {
            (_, true, false) => ("in-place buffer", "in-place layout"),
            (_, true, true) => ("in-place buffer (root)", "in-place layout (root)"),
            (Side::Input, false, false) => ("send buffer", "send layout"),
            (Side::Input, false, true) => ("send buffer (root)", "send layout (root)"),
            (Side::Output, false, false) => ("receive buffer", "receive layout"),
            (Side::Output, false, true) => ("receive buffer (root)", "receive layout (root)"),
        };
        let (len, layout_given, name) = match side {
            // In place the single buffer is the receive buffer, with the send layout.
            Side::Input if self.in_place => (self.recv_len, self.send_layout, "in-place"),
            Side::Input => (self.send_len, self.send_layout, "send"),
            Side::Output if self.in_place => (self.recv_len, self.recv_layout, "in-place"),
            Side::Output => (self.recv_len, self.recv_layout, "receive"),
        };
        Ok(Laid {
            len: need(len, buffer)?,
            layout: need(layout_given, layout)?,
            name,
        })
    }

    /// The buffer `Input` segments lie in: in place the single (receive) buffer.
    fn input_buf(&self) -> Buf {
        if self.in_place {
            Buf::Recv
        } else {
            Buf::Send
        }
    }
}

impl Laid<'_> {
    /// The layout fits the buffer and the communicator (see [`check_layout`]).
    fn check_read(&self, size: usize) -> Result<(), Broken> {
        check_layout(self.layout, self.name, size, self.len)
    }

    /// As [`Laid::check_read`], and the segments, which are written, do not overlap.
    fn check_written(&self, size: usize) -> Result<(), Broken> {
        self.check_read(size)?;
        check_disjoint(self.layout, self.name)
    }

    /// Peer `peer`'s count.
    fn count(&self, peer: usize) -> usize {
        self.layout.counts()[peer]
    }
}
