//! A small list that allocates only when it outgrows its inline room.

/// A list that keeps its first `N` items in place and only spills further ones to the heap:
/// most groups hold a few operations on a few communicators, and allocating for each group
/// would cost more than all of its bookkeeping.
pub(crate) struct InlineList<T, const N: usize> {
    inline: [Option<T>; N],
    len: usize,
    spilled: Vec<T>,
}

impl<T, const N: usize> InlineList<T, N> {
    pub(crate) fn new() -> Self {
        Self {
            inline: std::array::from_fn(|_| None),
            len: 0,
            spilled: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, item: T) {
        match self.inline.get_mut(self.len) {
            Some(slot) => *slot = Some(item),
            None => self.spilled.push(item),
        }
        self.len += 1;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The items in the order they were pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.inline.iter().flatten().chain(&self.spilled)
    }

    /// The items, mutably, in the order they were pushed.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.inline.iter_mut().flatten().chain(&mut self.spilled)
    }

    /// Drops every item, in the order they were pushed.
    pub(crate) fn clear(&mut self) {
        for slot in &mut self.inline {
            *slot = None;
        }
        self.spilled.clear();
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_list_keeps_order_past_its_inline_room() {
        let mut list: InlineList<String, 2> = InlineList::new();
        for i in 0..5 {
            list.push(i.to_string());
        }
        assert_eq!(list.len(), 5);
        assert_eq!(
            list.iter().cloned().collect::<Vec<_>>(),
            ["0", "1", "2", "3", "4"]
        );
        list.clear();
        assert_eq!(list.len(), 0);
        assert_eq!(list.iter().count(), 0);
        list.push("again".into());
        assert_eq!(list.iter().collect::<Vec<_>>(), ["again"]);
    }
}
