//! [`Layout`]: where each rank's segment lies in a buffer of a v-collective.

/// Where each rank's segment lies in one buffer of a v-collective: segment `i` is
/// `counts[i]` elements starting at element `displs[i]` (counts and displacements are in
/// elements, as everywhere in this crate).
///
/// [`Layout::packed`] puts the segments one after another in rank order (the usual case);
/// [`Layout::with_displacements`] places them anywhere, with gaps or in another order. A
/// `Vec<usize>` or `&[usize]` of counts converts into a packed layout, so
/// `comm.all_to_all_v(&send, vec![2, 0, 5], ...)` reads naturally.
///
/// A layout is checked when it is used, against the communicator size and the buffer: it
/// must have one count and one displacement per rank, every segment must lie inside the
/// buffer, and segments that are written must not overlap.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    counts: Vec<usize>,
    displs: Vec<usize>,
}

impl Layout {
    /// Segments of `counts[i]` elements, packed in rank order: segment `i` starts where
    /// segment `i - 1` ends.
    pub fn packed(counts: impl Into<Vec<usize>>) -> Self {
        let counts = counts.into();
        // A sum past usize::MAX fits no buffer; saturating keeps it that way, and the
        // in-buffer rule then rejects it with the segment named.
        let displs = counts
            .iter()
            .scan(0usize, |next, &count| {
                let start = *next;
                *next = next.saturating_add(count);
                Some(start)
            })
            .collect();
        Self { counts, displs }
    }

    /// `size` segments of `count` elements each, packed: the layout of the fixed-size
    /// collectives.
    pub fn even(size: usize, count: usize) -> Self {
        Self::packed(vec![count; size])
    }

    /// Segment `i` is `counts[i]` elements starting at element `displs[i]`. Both must have
    /// one entry per rank; that, and that the segments fit the buffer, is checked when the
    /// layout is used (naming the rank and the segment).
    pub fn with_displacements(
        counts: impl Into<Vec<usize>>,
        displs: impl Into<Vec<usize>>,
    ) -> Self {
        Self {
            counts: counts.into(),
            displs: displs.into(),
        }
    }

    /// The element count of each segment.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The first element of each segment.
    pub fn displs(&self) -> &[usize] {
        &self.displs
    }

    /// The number of segments (one per rank in a valid layout).
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether the layout has no segments.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The elements of segment `i`, or `None` if there is no such segment (or it does not
    /// fit in `usize`).
    pub fn segment(&self, i: usize) -> Option<std::ops::Range<usize>> {
        let (&count, &displ) = (self.counts.get(i)?, self.displs.get(i)?);
        Some(displ..displ.checked_add(count)?)
    }

    /// The sum of the counts: the elements the segments hold (saturating at `usize::MAX`).
    pub fn total(&self) -> usize {
        self.counts
            .iter()
            .fold(0usize, |sum, &count| sum.saturating_add(count))
    }

    /// The smallest buffer length that holds every segment (saturating at `usize::MAX`).
    pub fn extent(&self) -> usize {
        self.counts
            .iter()
            .zip(&self.displs)
            .map(|(&count, &displ)| displ.saturating_add(count))
            .max()
            .unwrap_or(0)
    }
}

impl From<Vec<usize>> for Layout {
    /// A packed layout of these counts.
    fn from(counts: Vec<usize>) -> Self {
        Self::packed(counts)
    }
}

impl From<&[usize]> for Layout {
    /// A packed layout of these counts.
    fn from(counts: &[usize]) -> Self {
        Self::packed(counts)
    }
}

impl<const N: usize> From<[usize; N]> for Layout {
    /// A packed layout of these counts.
    fn from(counts: [usize; N]) -> Self {
        Self::packed(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_segments_follow_each_other() {
        let layout = Layout::packed([3, 0, 2, 5]);
        assert_eq!(layout.counts(), &[3, 0, 2, 5]);
        assert_eq!(layout.displs(), &[0, 3, 3, 5]);
        assert_eq!(layout.total(), 10);
        assert_eq!(layout.extent(), 10);
        assert_eq!(layout.segment(2), Some(3..5));
        assert_eq!(layout.segment(1), Some(3..3));
        assert_eq!(layout.segment(4), None);
        assert_eq!(layout.len(), 4);
        assert!(!layout.is_empty());
        assert_eq!(Layout::from(vec![3, 0, 2, 5]), layout);
        assert_eq!(Layout::from(&[3usize, 0, 2, 5][..]), layout);
    }

    #[test]
    fn even_layout_is_the_fixed_size_one() {
        let layout = Layout::even(3, 4);
        assert_eq!(layout.displs(), &[0, 4, 8]);
        assert_eq!(layout.extent(), 12);
        assert_eq!(Layout::even(0, 4).extent(), 0);
        assert!(Layout::even(0, 4).is_empty());
    }

    #[test]
    fn displacements_may_leave_gaps_and_reorder() {
        let layout = Layout::with_displacements([2, 3], [10, 0]);
        assert_eq!(layout.segment(0), Some(10..12));
        assert_eq!(layout.segment(1), Some(0..3));
        assert_eq!(layout.total(), 5);
        assert_eq!(layout.extent(), 12);
    }

    #[test]
    fn sizes_past_usize_saturate_instead_of_wrapping() {
        let layout = Layout::packed([usize::MAX, 2, 1]);
        assert_eq!(layout.displs(), &[0, usize::MAX, usize::MAX]);
        assert_eq!(layout.total(), usize::MAX);
        assert_eq!(layout.extent(), usize::MAX);
        assert_eq!(layout.segment(1), None);
        // A layout with fewer displacements than counts has no such segment.
        assert_eq!(Layout::with_displacements([1, 2], [0]).segment(1), None);
    }
}
