//! Token-budget micro-batches: first-fit decreasing bin packing.
//!
//! FFD uses at most 11/9 OPT + 6/9 bins; with many short sequences it is usually within one bin
//! of ceil(total / budget). A max segment tree over the bins' free space finds the first bin that
//! fits in O(log bins), so packing n samples costs O(n log n).

/// Micro-batches of sample indices, each with a token sum of at most `max_tokens`; a sample
/// longer than `max_tokens` gets a bin of its own. Indices ascending within a bin; bins ordered
/// by their smallest index.
pub fn pack_token_budget(lengths: &[i64], max_tokens: i64) -> Vec<Vec<usize>> {
    let n = lengths.len();
    let mut order: Vec<usize> = (0..n).collect();
    // Longest first; ties by index, so the result is deterministic.
    order.sort_unstable_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));

    let mut tree = FreeSpaceTree::new(n.max(1));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for i in order {
        let len = lengths[i];
        if len > max_tokens {
            // Closed for everything else, even empty samples: -1 is below any need.
            tree.set(bins.len(), -1);
            bins.push(vec![i]);
            continue;
        }
        match tree.first_fitting(len) {
            Some(b) if b < bins.len() => {
                bins[b].push(i);
                tree.set(b, tree.get(b) - len);
            }
            _ => {
                tree.set(bins.len(), max_tokens - len);
                bins.push(vec![i]);
            }
        }
    }
    for bin in &mut bins {
        bin.sort_unstable();
    }
    bins.sort_unstable_by_key(|bin| bin[0]);
    bins
}

/// Free tokens per bin, in a max segment tree; bins not opened yet hold -1.
struct FreeSpaceTree {
    leaves: usize,
    node: Vec<i64>,
}

impl FreeSpaceTree {
    fn new(capacity: usize) -> Self {
        let leaves = capacity.next_power_of_two();
        Self { leaves, node: vec![-1; 2 * leaves] }
    }

    fn get(&self, bin: usize) -> i64 {
        self.node[self.leaves + bin]
    }

    fn set(&mut self, bin: usize, free: i64) {
        let mut k = self.leaves + bin;
        self.node[k] = free;
        while k > 1 {
            k /= 2;
            self.node[k] = self.node[2 * k].max(self.node[2 * k + 1]);
        }
    }

    /// Leftmost bin with at least `need` free tokens.
    fn first_fitting(&self, need: i64) -> Option<usize> {
        if self.node[1] < need {
            return None;
        }
        let mut k = 1;
        while k < self.leaves {
            k = if self.node[2 * k] >= need { 2 * k } else { 2 * k + 1 };
        }
        Some(k - self.leaves)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_example() {
        // budget 10: 8 -> bin A; 6 -> bin B; 4 -> B (10); 2 -> A (10); 11 -> own bin.
        let bins = pack_token_budget(&[4, 8, 11, 2, 6], 10);
        assert_eq!(bins, vec![vec![0, 4], vec![1, 3], vec![2]]);
    }

    #[test]
    fn empty_samples_never_join_an_oversize_bin() {
        let bins = pack_token_budget(&[20, 0], 10);
        assert_eq!(bins, vec![vec![0], vec![1]]);
    }
}
