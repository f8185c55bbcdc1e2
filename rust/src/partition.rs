//! Balanced k-way partitioning by the Karmarkar-Karp largest differencing method (LDM), the
//! algorithm verl uses to even out sequence lengths across data-parallel ranks.
//!
//! Every state is a k-tuple of sets sorted by total, largest first. Repeatedly the two states
//! with the largest spread (max total - min total) are merged by pairing the largest set of one
//! with the smallest of the other, which cancels most of both spreads. With `equal_size`, the
//! initial states take k items each (consecutive in sorted order, one per set), so every merge
//! keeps the set sizes equal.
//!
//! Ties are broken the same way as `rlcore.packing.balanced_partitions_python`, so both give the
//! same partitions: sets by (total desc, size desc, smallest index asc); states by (spread desc,
//! largest total desc, creation order asc).

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

const NONE: usize = usize::MAX;

#[derive(Clone, Copy)]
struct Set {
    sum: i64,
    count: usize,
    min_idx: usize,
    // Items as a linked list through `next`, so a merge is O(1).
    head: usize,
    tail: usize,
}

impl Set {
    const EMPTY: Set = Set { sum: 0, count: 0, min_idx: NONE, head: NONE, tail: NONE };

    /// Larger totals first, then more items, then the smaller first index.
    fn order(a: &Set, b: &Set) -> Ordering {
        b.sum.cmp(&a.sum).then(b.count.cmp(&a.count)).then(a.min_idx.cmp(&b.min_idx))
    }
}

/// Partitions of `0..lengths.len()` into `k` groups with near-equal length totals.
/// Callers validate: `k >= 1`, `lengths.len() >= k`, and `len % k == 0` when `equal_size`.
pub fn balanced_partitions(lengths: &[i64], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    let n = lengths.len();
    let mut next = vec![NONE; n];
    let mut sorted: Vec<usize> = (0..n).collect();
    sorted.sort_unstable_by(|&a, &b| lengths[a].cmp(&lengths[b]).then(a.cmp(&b)));

    let singleton = |i: usize| Set { sum: lengths[i], count: 1, min_idx: i, head: i, tail: i };
    let mut states: Vec<Vec<Set>> = Vec::new();
    if equal_size {
        for group in sorted.chunks(k) {
            let mut sets: Vec<Set> = group.iter().map(|&i| singleton(i)).collect();
            sets.sort_by(Set::order);
            states.push(sets);
        }
    } else {
        for &i in &sorted {
            let mut sets = vec![Set::EMPTY; k];
            sets[0] = singleton(i);
            states.push(sets);
        }
    }

    // Max-heap on (spread, largest total, earliest creation); states live in `arena`.
    let mut heap = BinaryHeap::new();
    let mut arena: Vec<Option<Vec<Set>>> = Vec::with_capacity(2 * states.len());
    for sets in states {
        heap.push((key(&sets), Reverse(arena.len())));
        arena.push(Some(sets));
    }
    while heap.len() > 1 {
        let (_, Reverse(a)) = heap.pop().expect("heap has two states");
        let (_, Reverse(b)) = heap.pop().expect("heap has two states");
        let mut sa = arena[a].take().expect("state used once");
        let sb = arena[b].take().expect("state used once");
        for (x, y) in sa.iter_mut().zip(sb.iter().rev()) {
            merge_into(x, y, &mut next);
        }
        sa.sort_by(Set::order);
        heap.push((key(&sa), Reverse(arena.len())));
        arena.push(Some(sa));
    }

    let mut parts: Vec<Vec<usize>> = match heap.pop() {
        Some((_, Reverse(s))) => arena[s]
            .take()
            .expect("final state")
            .iter()
            .map(|set| {
                let mut items = Vec::with_capacity(set.count);
                let mut cur = set.head;
                while cur != NONE {
                    items.push(cur);
                    cur = next[cur];
                }
                items.sort_unstable();
                items
            })
            .collect(),
        None => vec![Vec::new(); k],
    };
    parts.sort_by_key(|p| p.first().copied().unwrap_or(NONE));
    parts
}

fn key(sets: &[Set]) -> (i64, i64) {
    let top = sets[0].sum;
    (top - sets[sets.len() - 1].sum, top)
}

fn merge_into(x: &mut Set, y: &Set, next: &mut [usize]) {
    if y.count == 0 {
        return;
    }
    if x.count == 0 {
        *x = *y;
        return;
    }
    next[x.tail] = y.head;
    x.tail = y.tail;
    x.sum += y.sum;
    x.count += y.count;
    x.min_idx = x.min_idx.min(y.min_idx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_ldm_example() {
        // LDM on {8,7,6,5,4}, k=2: 8-7 -> 1, 6-5 -> 1, then 4,1,1 -> 3,1 -> 2: totals 16 and 14.
        let parts = balanced_partitions(&[8, 7, 6, 5, 4], 2, false);
        let mut totals: Vec<i64> = parts.iter().map(|p| p.iter().map(|&i| [8, 7, 6, 5, 4][i]).sum()).collect();
        totals.sort_unstable();
        assert_eq!(totals, vec![14, 16]);
    }

    #[test]
    fn equal_size_counts() {
        let lengths: Vec<i64> = (0..12).map(|i| (i * 37 % 11) as i64).collect();
        for p in balanced_partitions(&lengths, 3, true) {
            assert_eq!(p.len(), 4);
        }
    }
}
