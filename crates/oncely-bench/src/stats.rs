//! The two summaries every benchmark prints: the median of its rounds and a latency
//! quantile. One definition for all of them, so that a figure means the same in each.

/// The median of `values` (sorted in place): the middle value, or the mean of the two
/// middle values for an even count; 0 for none.
pub(crate) fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => f64::midpoint(values[n / 2 - 1], values[n / 2]),
    }
}

/// The `q` quantile (0–1) of `sorted` (ascending), by nearest rank: the smallest value
/// with at least `q` of the values at or below it. `None` for no values.
pub(crate) fn quantile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(median(&mut [3.0, 1.0, 2.0]), 2.0));
        assert!(close(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5));
        assert!(close(median(&mut []), 0.0));
    }

    #[test]
    fn a_quantile_is_the_nearest_rank() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!(quantile(&v, 0.5), Some(50));
        assert_eq!(quantile(&v, 0.99), Some(99));
        assert_eq!(quantile(&v, 1.0), Some(100));
        assert_eq!(quantile(&v, 0.0), Some(1));
        assert_eq!(quantile::<u32>(&[], 0.5), None);
    }
}
