//! Outcome advantages normalised within groups of samples that share a prompt (GRPO family).
//!
//! Group statistics are accumulated in f64 (two passes: mean, then squared deviations), so a
//! group of identical scores has exactly zero spread and the result does not depend on the
//! order of the samples. A group of one sample keeps its raw score in every mode (verl uses
//! mean 0 and std 1 there, which for grpo gives s / (1 + eps); we keep exactly s so the rule is
//! the same for every mode, as the torch reference in rlcore.algos does).

use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// (s - mean) / (std + eps), std unbiased (torch.std).
    Grpo,
    /// s - mean (Dr. GRPO: no std scaling).
    DrGrpo,
    /// s minus the mean of the other samples of the group: (s - mean) * n / (n - 1).
    Rloo,
    /// s - mean (REINFORCE++ with a group-mean baseline).
    ReinforcePlusPlusBaseline,
}

pub const MODE_NAMES: &str = "grpo, drgrpo, rloo, reinforce_plus_plus_baseline";

impl Mode {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "grpo" => Some(Mode::Grpo),
            "drgrpo" => Some(Mode::DrGrpo),
            "rloo" => Some(Mode::Rloo),
            "reinforce_plus_plus_baseline" => Some(Mode::ReinforcePlusPlusBaseline),
            _ => None,
        }
    }
}

/// One advantage per sample. `ids` may be in any order and need not be contiguous.
pub fn group_advantages(scores: &[f32], ids: &[i64], mode: Mode, eps: f64) -> Vec<f32> {
    let n = scores.len();
    assert_eq!(ids.len(), n);
    // Visit samples grouped by id. Rollouts put the n samples of a prompt next to each other,
    // so the ids are usually sorted already and no sort is needed.
    let order: Vec<u32> = if ids.windows(2).all(|w| w[0] <= w[1]) {
        (0..n as u32).collect()
    } else {
        let mut keyed: Vec<(i64, u32)> = ids.iter().copied().zip(0..n as u32).collect();
        // The index in the key makes the unstable sort deterministic.
        keyed.par_sort_unstable();
        keyed.into_iter().map(|(_, i)| i).collect()
    };

    let mut out = vec![0.0f32; n];
    let mut start = 0;
    while start < n {
        let id = ids[order[start] as usize];
        let mut end = start + 1;
        while end < n && ids[order[end] as usize] == id {
            end += 1;
        }
        let members = &order[start..end];
        if members.len() == 1 {
            let i = members[0] as usize;
            out[i] = scores[i];
            start = end;
            continue;
        }
        let (mean, std) = stats(scores, members);
        let count = members.len() as f64;
        for &i in members {
            let s = scores[i as usize] as f64;
            out[i as usize] = advantage(s, mean, std, count, mode, eps) as f32;
        }
        start = end;
    }
    out
}

/// Mean and unbiased std of a group of at least two samples.
fn stats(scores: &[f32], members: &[u32]) -> (f64, f64) {
    let n = members.len();
    let mean = members.iter().map(|&i| scores[i as usize] as f64).sum::<f64>() / n as f64;
    let ss: f64 = members
        .iter()
        .map(|&i| {
            let d = scores[i as usize] as f64 - mean;
            d * d
        })
        .sum();
    (mean, (ss / (n - 1) as f64).sqrt())
}

fn advantage(s: f64, mean: f64, std: f64, n: f64, mode: Mode, eps: f64) -> f64 {
    match mode {
        Mode::Grpo => {
            if std == 0.0 {
                0.0
            } else {
                (s - mean) / (std + eps)
            }
        }
        Mode::DrGrpo | Mode::ReinforcePlusPlusBaseline => s - mean,
        Mode::Rloo => (s - mean) * n / (n - 1.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpo_by_hand() {
        // group 7: [1, 3] -> mean 2, std sqrt(2); group -1: [5] singleton keeps its score.
        let a = group_advantages(&[1.0, 5.0, 3.0], &[7, -1, 7], Mode::Grpo, 1e-6);
        let s2 = 2f32.sqrt();
        assert!((a[0] + 1.0 / s2).abs() < 1e-6 && (a[2] - 1.0 / s2).abs() < 1e-6);
        assert_eq!(a[1], 5.0);
    }

    #[test]
    fn rloo_is_score_minus_mean_of_others() {
        let a = group_advantages(&[1.0, 2.0, 6.0], &[0, 0, 0], Mode::Rloo, 1e-6);
        assert_eq!(a, vec![1.0 - 4.0, 2.0 - 3.5, 6.0 - 1.5]);
    }
}
