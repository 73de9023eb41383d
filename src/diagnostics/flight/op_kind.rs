//! The kind of operation a flight entry records ([`OpKind`]), shared by the records, the
//! shipped kernels' calls and the CUDA graphs' replays.

/// The kind of operation an entry records: one NCCL call, one launch of a kernel this
/// crate ships (the `Lsa` kinds, see [Shipped kernels](super#shipped-kernels)), or one
/// launch of a CUDA graph ([`OpKind::GraphReplay`], see [CUDA graphs](super#cuda-graphs)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `ncclAllReduce`
    AllReduce,
    /// `ncclBroadcast`
    Broadcast,
    /// `ncclReduce`
    Reduce,
    /// `ncclAllGather`
    AllGather,
    /// `ncclReduceScatter`
    ReduceScatter,
    /// `ncclAlltoAll`
    AllToAll,
    /// `ncclGather`
    Gather,
    /// `ncclScatter`
    Scatter,
    /// `ncclSend`
    Send,
    /// `ncclRecv`
    Recv,
    /// [`LsaAllReduce::all_reduce`](crate::device::LsaAllReduce::all_reduce) (or in place)
    /// with a shipped kernel.
    LsaAllReduce,
    /// [`LsaAllReduce::all_gather`](crate::device::LsaAllReduce::all_gather).
    LsaAllGather,
    /// The norm of
    /// [`LsaAllReduce::all_reduce_add_rms_norm`](crate::device::LsaAllReduce::all_reduce_add_rms_norm)
    /// (or `_to`): fused with its all-reduce, or after it.
    LsaAddRmsNorm,
    /// A launch of a CUDA graph that captured operations of the communicator
    /// ([`RecordedGraph::record_replay`](super::RecordedGraph::record_replay)): one replay
    /// of them all, numbered among its graph's replays
    /// ([`FlightEntry::replay`](super::FlightEntry::replay)); its count is the number of
    /// operations the graph captured.
    GraphReplay,
    /// [`ExpertExchange::dispatch`](crate::device::ExpertExchange::dispatch) on the shipped
    /// kernels (its count: the tokens this rank sent).
    LsaExpertDispatch,
    /// [`ExpertExchange::combine`](crate::device::ExpertExchange::combine) on the shipped
    /// kernels (its count: the tokens this rank summed).
    LsaExpertCombine,
}

impl OpKind {
    /// Every kind, in the order of their raw tags.
    pub const ALL: [OpKind; 16] = [
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::Send,
        OpKind::Recv,
        OpKind::LsaAllReduce,
        OpKind::LsaAllGather,
        OpKind::LsaAddRmsNorm,
        OpKind::GraphReplay,
        OpKind::LsaExpertDispatch,
        OpKind::LsaExpertCombine,
    ];

    /// The name in records and dumps, e.g. `"AllReduce"`.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "AllReduce",
            OpKind::Broadcast => "Broadcast",
            OpKind::Reduce => "Reduce",
            OpKind::AllGather => "AllGather",
            OpKind::ReduceScatter => "ReduceScatter",
            OpKind::AllToAll => "AllToAll",
            OpKind::Gather => "Gather",
            OpKind::Scatter => "Scatter",
            OpKind::Send => "Send",
            OpKind::Recv => "Recv",
            OpKind::LsaAllReduce => "LsaAllReduce",
            OpKind::LsaAllGather => "LsaAllGather",
            OpKind::LsaAddRmsNorm => "LsaAddRmsNorm",
            OpKind::GraphReplay => "GraphReplay",
            OpKind::LsaExpertDispatch => "LsaExpertDispatch",
            OpKind::LsaExpertCombine => "LsaExpertCombine",
        }
    }

    /// The kind named `name` (as [`OpKind::name`] writes it).
    pub fn from_name(name: &str) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|kind| kind.name() == name)
    }

    /// Whether every rank takes part (a collective, a shipped kernel's launch, a graph's
    /// replay), rather than one peer (send, receive).
    pub fn is_collective(self) -> bool {
        !matches!(self, OpKind::Send | OpKind::Recv)
    }

    /// Whether it is a launch of a kernel this crate ships (numbered among its instance's
    /// calls, [`FlightEntry::shipped`](super::FlightEntry::shipped), not among NCCL's
    /// collectives).
    pub fn is_shipped(self) -> bool {
        matches!(
            self,
            OpKind::LsaAllReduce
                | OpKind::LsaAllGather
                | OpKind::LsaAddRmsNorm
                | OpKind::LsaExpertDispatch
                | OpKind::LsaExpertCombine
        )
    }

    /// Whether it is an NCCL call (numbered among NCCL's collectives where it is one), not
    /// a shipped kernel's launch or a CUDA graph's replay, which are numbered apart.
    pub fn is_nccl(self) -> bool {
        !self.is_shipped() && self != OpKind::GraphReplay
    }

    /// Whether the operation has a root.
    pub fn has_root(self) -> bool {
        matches!(
            self,
            OpKind::Broadcast | OpKind::Reduce | OpKind::Gather | OpKind::Scatter
        )
    }

    pub(crate) fn tag(self) -> u8 {
        self as u8
    }
}
