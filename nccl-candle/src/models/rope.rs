//! The rotary embedding's frequencies (Llama 3's scaling included).

use super::config::{Llama3RopeScaling, ModelConfig};

/// The rotary frequencies, `theta^(-2i/head_dim)`, with Llama 3's scaling when set (long
/// wavelengths divided by `factor`, short ones kept, a smooth blend between).
pub(super) fn inverse_frequencies(cfg: &ModelConfig) -> Vec<f64> {
    let hd = cfg.head_dim;
    (0..hd / 2)
        .map(|i| {
            let freq = cfg.rope_theta.powf(-2.0 * i as f64 / hd as f64);
            match cfg.rope_scaling {
                None => freq,
                Some(Llama3RopeScaling {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    let original = original_max_position_embeddings as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < original / high_freq_factor {
                        freq
                    } else if wavelen > original / low_freq_factor {
                        freq / factor
                    } else {
                        let smooth = (original / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                }
            }
        })
        .collect()
}
