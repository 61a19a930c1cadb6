//! Which sampling values apply to a run: the user's, else the model's, else Kiln's.
//!
//! A model's `generation_config.json` often states the sampling its authors tuned it for
//! (Qwen2.5 Instruct: temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05; Llama 3
//! Instruct: temperature 0.6, top-p 0.9). As transformers' `generate` and vLLM do, those values
//! are the defaults when the user gives none; each flag the user gives wins over the file, key
//! by key; a key neither names keeps [`SamplingParams::default`] (llama.cpp's). A GGUF file
//! has no `generation_config.json`, so llama.cpp's defaults apply there, as in llama.cpp.

use super::{InvalidSamplingParams, SamplingParams};

/// The sampling values one source states; `None`: that source says nothing about the key.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingChoice {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// Where a value that was used came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag.
    Flag,
    /// The model's `generation_config.json`.
    Model,
    /// Kiln's default ([`SamplingParams::default`]).
    Default,
}

impl Origin {
    /// The name `kiln run --json` gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Flag => "flag",
            Origin::Model => "generation_config.json",
            Origin::Default => "default",
        }
    }
}

/// The parameters a run uses, with where each of the keys a model can set came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResolvedSampling {
    pub params: SamplingParams,
    /// `(key, origin)` for temperature, top_k, top_p, min_p and repetition_penalty.
    pub origins: [(&'static str, Origin); 5],
}

impl SamplingChoice {
    /// Whether the source states nothing.
    pub fn is_empty(&self) -> bool {
        *self == SamplingChoice::default()
    }

    /// Checks each stated value's range (the ranges of [`SamplingParams::validate`]).
    pub fn validate(&self) -> Result<(), InvalidSamplingParams> {
        self.over(SamplingParams::default()).validate()
    }

    /// `base` with the values this source states.
    fn over(&self, base: SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            ..base
        }
    }

    /// The parameters to use: each key from `flags` if given there, else from `model` (the
    /// model's `generation_config.json`), else from `base`, which also supplies what a model
    /// cannot set (seed, frequency and presence penalties).
    pub fn resolve(flags: &SamplingChoice, model: &SamplingChoice, base: SamplingParams) -> ResolvedSampling {
        let params = flags.over(model.over(base));
        let origin = |flag: bool, file: bool| {
            if flag {
                Origin::Flag
            } else if file {
                Origin::Model
            } else {
                Origin::Default
            }
        };
        let origins = [
            (
                "temperature",
                origin(flags.temperature.is_some(), model.temperature.is_some()),
            ),
            ("top_k", origin(flags.top_k.is_some(), model.top_k.is_some())),
            ("top_p", origin(flags.top_p.is_some(), model.top_p.is_some())),
            ("min_p", origin(flags.min_p.is_some(), model.min_p.is_some())),
            (
                "repetition_penalty",
                origin(flags.repetition_penalty.is_some(), model.repetition_penalty.is_some()),
            ),
        ];
        ResolvedSampling { params, origins }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5 Instruct's generation_config.json.
    fn qwen() -> SamplingChoice {
        SamplingChoice {
            temperature: Some(0.7),
            top_k: Some(20),
            top_p: Some(0.8),
            min_p: None,
            repetition_penalty: Some(1.05),
        }
    }

    #[test]
    fn without_flags_the_models_values_apply_and_the_rest_is_kilns() {
        let r = SamplingChoice::resolve(&SamplingChoice::default(), &qwen(), SamplingParams::default());
        assert_eq!(r.params.temperature, 0.7);
        assert_eq!(r.params.top_k, 20);
        assert_eq!(r.params.top_p, 0.8);
        assert_eq!(r.params.repetition_penalty, 1.05);
        // Not in the file: Kiln's (llama.cpp's) default.
        assert_eq!(r.params.min_p, 0.05);
        assert_eq!(r.origins[0], ("temperature", Origin::Model));
        assert_eq!(r.origins[3], ("min_p", Origin::Default));
    }

    #[test]
    fn each_flag_wins_over_the_file_key_by_key() {
        let flags = SamplingChoice {
            temperature: Some(0.0),
            min_p: Some(0.1),
            ..SamplingChoice::default()
        };
        let base = SamplingParams {
            seed: Some(9),
            presence_penalty: 0.5,
            ..SamplingParams::default()
        };
        let r = SamplingChoice::resolve(&flags, &qwen(), base);
        assert_eq!(r.params.temperature, 0.0);
        assert_eq!(r.params.min_p, 0.1);
        assert_eq!(r.params.top_k, 20, "not given: the file's");
        assert_eq!(r.params.seed, Some(9), "the base keeps what a model cannot set");
        assert_eq!(r.params.presence_penalty, 0.5);
        assert_eq!(r.origins[0].1, Origin::Flag);
        assert_eq!(r.origins[1].1, Origin::Model);
        assert_eq!(r.origins[3].1, Origin::Flag);
    }

    #[test]
    fn no_model_values_keep_kilns_defaults() {
        // A GGUF file, or a generation_config.json with only token ids.
        let r = SamplingChoice::resolve(
            &SamplingChoice::default(),
            &SamplingChoice::default(),
            SamplingParams::default(),
        );
        assert_eq!(r.params, SamplingParams::default());
        assert!(r.origins.iter().all(|(_, o)| *o == Origin::Default));
    }

    #[test]
    fn stated_values_are_range_checked() {
        assert!(qwen().validate().is_ok());
        let bad = SamplingChoice {
            top_p: Some(1.5),
            ..SamplingChoice::default()
        };
        assert_eq!(bad.validate().unwrap_err().name, "top_p");
        let bad = SamplingChoice {
            temperature: Some(-1.0),
            ..SamplingChoice::default()
        };
        assert_eq!(bad.validate().unwrap_err().name, "temperature");
    }
}
