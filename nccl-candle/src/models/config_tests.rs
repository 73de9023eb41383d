//! The configuration parser against real configurations and every refusal.
use super::*;

// The config.json files of public checkpoints, as published.
const LLAMA_2_7B: &str = r#"{
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}"#;

const LLAMA_3_1_8B_INSTRUCT: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
"factor": 8.0,
"low_freq_factor": 1.0,
"high_freq_factor": 4.0,
"original_max_position_embeddings": 8192,
"rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}"#;

const MISTRAL_7B_V0_1: &str = r#"{
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}"#;

const MISTRAL_7B_INSTRUCT_V0_3: &str = r#"{
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
}"#;

const QWEN2_7B_INSTRUCT: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 3584,
  "initializer_range": 0.02,
  "intermediate_size": 18944,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2",
  "num_attention_heads": 28,
  "num_hidden_layers": 28,
  "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 131072,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.41.2",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 152064
}"#;

const QWEN3_0_6B: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

fn path() -> &'static Path {
    Path::new("/models/m/config.json")
}

fn parse(text: &str) -> ModelConfig {
    ModelConfig::from_json(text, path()).unwrap_or_else(|err| panic!("{err}"))
}

/// `base` with `edit` applied to its top-level object.
fn edited(base: &str, edit: impl FnOnce(&mut Map<String, Value>)) -> String {
    let mut value: Value = serde_json::from_str(base).unwrap();
    edit(value.as_object_mut().unwrap());
    value.to_string()
}

/// The fault and the why of a refused text, checking the path is named.
fn refused(text: &str) -> (CheckpointFault, String) {
    match ModelConfig::from_json(text, path()) {
        Err(Error::Checkpoint {
            path: at,
            fault,
            why,
        }) => {
            assert_eq!(at, path());
            (fault, why)
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

fn assert_refused(text: &str, fault: CheckpointFault, names: &[&str]) -> String {
    let (got, why) = refused(text);
    assert_eq!(got, fault, "{why}");
    for name in names {
        assert!(why.contains(name), "{why:?} does not name {name:?}");
    }
    why
}

#[test]
fn llama_2_7b() {
    let config = parse(LLAMA_2_7B);
    assert_eq!(
        config,
        ModelConfig {
            family: Family::Llama,
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            // Absent: transformers' default.
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 4096,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            torch_dtype: Some("float16".into()),
            experts: None,
        }
    );
    assert_eq!((config.q_width(), config.kv_width()), (4096, 4096));
}

#[test]
fn llama_3_1_8b_instruct() {
    let config = parse(LLAMA_3_1_8B_INSTRUCT);
    assert_eq!(
        config,
        ModelConfig {
            family: Family::Llama,
            vocab_size: 128256,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            bos_token_id: Some(128000),
            eos_token_ids: vec![128001, 128008, 128009],
            torch_dtype: Some("bfloat16".into()),
            experts: None,
        }
    );
    assert_eq!((config.q_width(), config.kv_width()), (4096, 1024));
}

#[test]
fn mistral_7b_v0_1_has_its_window() {
    let config = parse(MISTRAL_7B_V0_1);
    assert_eq!(
        config,
        ModelConfig {
            family: Family::Mistral,
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: Some(4096),
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            torch_dtype: Some("bfloat16".into()),
            experts: None,
        }
    );
}

#[test]
fn mistral_7b_instruct_v0_3_has_no_window() {
    let config = parse(MISTRAL_7B_INSTRUCT_V0_3);
    assert_eq!(config.family, Family::Mistral);
    assert_eq!(config.vocab_size, 32768);
    assert_eq!(config.sliding_window, None);
    assert_eq!(config.rope_theta, 1_000_000.0);
    assert_eq!(config.num_key_value_heads, 8);
    assert_eq!(config.head_dim, 128);
    assert_eq!(config.kv_width(), 1024);
    assert!(!config.qkv_bias && !config.o_bias && !config.mlp_bias && !config.qk_norm);
}

#[test]
fn qwen2_7b_instruct_has_qkv_biases_and_no_window() {
    let config = parse(QWEN2_7B_INSTRUCT);
    assert_eq!(
        config,
        ModelConfig {
            family: Family::Qwen2,
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 32768,
            tie_word_embeddings: false,
            // No attention_bias in the file: Qwen2 always has them on q, k, v.
            qkv_bias: true,
            o_bias: false,
            mlp_bias: false,
            qk_norm: false,
            // sliding_window 131072 is there, but use_sliding_window is false.
            sliding_window: None,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645],
            torch_dtype: Some("bfloat16".into()),
            experts: None,
        }
    );
    assert_eq!((config.q_width(), config.kv_width()), (3584, 512));
}

#[test]
fn qwen3_0_6b_has_its_own_head_dim() {
    let config = parse(QWEN3_0_6B);
    assert_eq!(
        config,
        ModelConfig {
            family: Family::Qwen3,
            vocab_size: 151936,
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            // Not 1024 / 16 = 64.
            head_dim: 128,
            rms_norm_eps: 1e-6,
            // Written as an integer.
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 40960,
            tie_word_embeddings: true,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            qk_norm: true,
            sliding_window: None,
            bos_token_id: Some(151643),
            eos_token_ids: vec![151645],
            torch_dtype: Some("bfloat16".into()),
            experts: None,
        }
    );
    assert_eq!((config.q_width(), config.kv_width()), (2048, 1024));
}

#[test]
fn family_from_either_field() {
    let by_architecture = parse(&edited(QWEN2_7B_INSTRUCT, |map| {
        map.remove("model_type");
    }));
    assert_eq!(by_architecture.family, Family::Qwen2);
    let by_type = parse(&edited(MISTRAL_7B_V0_1, |map| {
        map.remove("architectures");
    }));
    assert_eq!(by_type.family, Family::Mistral);
    for family in [Family::Llama, Family::Mistral, Family::Qwen2, Family::Qwen3] {
        let text = edited(LLAMA_2_7B, |map| {
            map.insert("model_type".into(), family.model_type().into());
            map.insert("architectures".into(), Value::Null);
        });
        assert_eq!(parse(&text).family, family);
    }
    assert_eq!(Family::Qwen3.model_type(), "qwen3");
    assert_eq!(Family::Mistral.architecture(), "MistralForCausalLM");
}

#[test]
fn family_fields_that_disagree_are_malformed() {
    let text = edited(LLAMA_2_7B, |map| {
        map.insert("model_type".into(), "qwen2".into());
    });
    assert_refused(
        &text,
        CheckpointFault::Malformed,
        &[
            "model_type",
            "qwen2",
            "architectures[0]",
            "LlamaForCausalLM",
        ],
    );
    let text = edited(LLAMA_2_7B, |map| {
        map.remove("model_type");
        map.remove("architectures");
    });
    assert_refused(
        &text,
        CheckpointFault::Malformed,
        &["model_type", "architectures"],
    );
}

#[test]
fn nulls_and_absences_take_the_defaults() {
    let config = parse(&edited(LLAMA_3_1_8B_INSTRUCT, |map| {
        map.insert("head_dim".into(), Value::Null);
        map.insert("num_key_value_heads".into(), Value::Null);
        map.insert("bos_token_id".into(), Value::Null);
        map.insert("eos_token_id".into(), Value::Null);
        map.insert("rope_scaling".into(), Value::Null);
        map.remove("rope_theta");
        map.remove("torch_dtype");
        map.remove("hidden_act");
        map.remove("attention_bias");
        map.remove("mlp_bias");
        map.remove("tie_word_embeddings");
    }));
    assert_eq!(config.head_dim, 128);
    assert_eq!(config.num_key_value_heads, 32);
    assert_eq!(config.bos_token_id, None);
    assert!(config.eos_token_ids.is_empty());
    assert_eq!(config.rope_scaling, None);
    assert_eq!(config.rope_theta, 10000.0);
    assert_eq!(config.torch_dtype, None);
    assert!(!config.tie_word_embeddings && !config.qkv_bias && !config.mlp_bias);
    // A Qwen3 file without head_dim: Qwen3Config's default, 128 (not hidden / heads, 64).
    let config = parse(&edited(QWEN3_0_6B, |map| {
        map.remove("head_dim");
    }));
    assert_eq!(config.head_dim, 128);
}

#[test]
fn an_explicit_head_dim_wins_for_every_family() {
    // Mistral-Nemo's shape: hidden 5120, 32 heads, head_dim 128 (not 160).
    let config = parse(&edited(MISTRAL_7B_INSTRUCT_V0_3, |map| {
        map.insert("hidden_size".into(), 5120.into());
        map.insert("head_dim".into(), 128.into());
    }));
    assert_eq!(config.head_dim, 128);
    assert_eq!(config.q_width(), 4096);
}

#[test]
fn llama_biases_follow_the_file_and_qwen3_keeps_o_bias_with_qkv() {
    let config = parse(&edited(LLAMA_2_7B, |map| {
        map.insert("attention_bias".into(), true.into());
        map.insert("mlp_bias".into(), true.into());
    }));
    assert!(config.qkv_bias && config.o_bias && config.mlp_bias);
    let config = parse(&edited(QWEN3_0_6B, |map| {
        map.insert("attention_bias".into(), true.into());
        map.insert("mlp_bias".into(), true.into());
    }));
    assert!(config.qkv_bias && config.o_bias && !config.mlp_bias);
    // Mistral's and Qwen2's modelling ignore these fields.
    let config = parse(&edited(MISTRAL_7B_V0_1, |map| {
        map.insert("attention_bias".into(), true.into());
    }));
    assert!(!config.qkv_bias && !config.o_bias);
    let config = parse(&edited(QWEN2_7B_INSTRUCT, |map| {
        map.insert("attention_bias".into(), false.into());
    }));
    assert!(config.qkv_bias && !config.o_bias);
}

#[test]
fn dtype_and_older_rope_type_spelling() {
    let config = parse(&edited(LLAMA_3_1_8B_INSTRUCT, |map| {
        map.remove("torch_dtype");
        map.insert("dtype".into(), "float32".into());
        let scaling = map["rope_scaling"].as_object_mut().unwrap();
        scaling.remove("rope_type");
        scaling.insert("type".into(), "llama3".into());
    }));
    assert_eq!(config.torch_dtype.as_deref(), Some("float32"));
    assert_eq!(config.rope_scaling.map(|s| s.factor), Some(8.0));
    let config = parse(&edited(LLAMA_2_7B, |map| {
        map.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "default"}),
        );
    }));
    assert_eq!(config.rope_scaling, None);
}

#[test]
fn transformers_5_rope_parameters() {
    let config = parse(&edited(LLAMA_3_1_8B_INSTRUCT, |map| {
        let scaling = map.remove("rope_scaling").unwrap();
        map.remove("rope_theta");
        let mut parameters = scaling.as_object().unwrap().clone();
        parameters.insert("rope_theta".into(), 500000.0.into());
        map.insert("rope_parameters".into(), parameters.into());
    }));
    assert_eq!(config.rope_theta, 500000.0);
    assert_eq!(
        config
            .rope_scaling
            .map(|s| s.original_max_position_embeddings),
        Some(8192)
    );
    let config = parse(&edited(QWEN3_0_6B, |map| {
        map.remove("rope_theta");
        map.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": 1000000.0, "rope_type": "default"}),
        );
    }));
    assert_eq!(
        (config.rope_theta, config.rope_scaling),
        (1_000_000.0, None)
    );
    let text = edited(QWEN3_0_6B, |map| {
        map.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": 10000.0}),
        );
    });
    assert_refused(
        &text,
        CheckpointFault::Malformed,
        &["rope_theta", "rope_parameters.rope_theta"],
    );
}

#[test]
fn from_file_reads_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.json");
    std::fs::write(&file, QWEN3_0_6B).unwrap();
    assert_eq!(ModelConfig::from_file(&file).unwrap(), parse(QWEN3_0_6B));

    let absent = dir.path().join("absent.json");
    match ModelConfig::from_file(&absent) {
        Err(Error::Checkpoint {
            path: at,
            fault: CheckpointFault::Missing,
            why,
        }) => {
            assert_eq!(at, absent);
            let io = std::fs::read(&absent).unwrap_err().to_string();
            assert!(why.contains(&io), "{why:?} lacks {io:?}");
        }
        other => panic!("expected Missing, got {other:?}"),
    }

    std::fs::write(&file, b"{\"vocab_size\": \xff}").unwrap();
    assert!(matches!(
        ModelConfig::from_file(&file),
        Err(Error::Checkpoint {
            fault: CheckpointFault::Malformed,
            ..
        })
    ));
}

#[test]
fn not_a_json_object_is_malformed() {
    assert_refused(
        "{\"vocab_size\": ",
        CheckpointFault::Malformed,
        &["not JSON"],
    );
    assert_refused(
        "[1, 2]",
        CheckpointFault::Malformed,
        &["expected a JSON object", "[1,2]"],
    );
}

#[test]
fn a_field_of_the_wrong_type_is_malformed_and_named() {
    let why = assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("hidden_size".into(), "abc".into());
        }),
        CheckpointFault::Malformed,
        &["hidden_size"],
    );
    assert_eq!(
        why,
        "hidden_size: expected a non-negative integer, found \"abc\""
    );
    // Integers must be written as integers, and not be negative.
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("hidden_size".into(), 4096.0.into());
        }),
        CheckpointFault::Malformed,
        &["hidden_size", "4096.0"],
    );
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("num_key_value_heads".into(), (-8).into());
        }),
        CheckpointFault::Malformed,
        &["num_key_value_heads", "-8"],
    );
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("rms_norm_eps".into(), "1e-5".into());
        }),
        CheckpointFault::Malformed,
        &["rms_norm_eps", "a number"],
    );
    assert_refused(
        &edited(QWEN3_0_6B, |map| {
            map.insert("tie_word_embeddings".into(), "yes".into());
        }),
        CheckpointFault::Malformed,
        &["tie_word_embeddings"],
    );
    assert_refused(
        &edited(LLAMA_3_1_8B_INSTRUCT, |map| {
            map.insert("eos_token_id".into(), serde_json::json!([128001, "x"]));
        }),
        CheckpointFault::Malformed,
        &["eos_token_id[1]"],
    );
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("bos_token_id".into(), 4_294_967_296u64.into());
        }),
        CheckpointFault::Malformed,
        &["bos_token_id"],
    );
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("rope_scaling".into(), "llama3".into());
        }),
        CheckpointFault::Malformed,
        &["rope_scaling"],
    );
}

#[test]
fn missing_required_fields_are_all_named() {
    let why = assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.remove("hidden_size");
            map.insert("num_hidden_layers".into(), Value::Null);
            map.remove("rms_norm_eps");
        }),
        CheckpointFault::Malformed,
        &[],
    );
    assert_eq!(
        why,
        "missing required fields: hidden_size, num_hidden_layers, rms_norm_eps"
    );
}

#[test]
fn another_architecture_is_unsupported() {
    let gemma = edited(LLAMA_2_7B, |map| {
        map.insert("model_type".into(), "gemma".into());
        map.insert(
            "architectures".into(),
            serde_json::json!(["GemmaForCausalLM"]),
        );
    });
    assert_refused(
        &gemma,
        CheckpointFault::Unsupported,
        &["gemma", "llama, mistral, qwen2, qwen3, mixtral, qwen3_moe"],
    );
    let phi = edited(LLAMA_2_7B, |map| {
        map.remove("model_type");
        map.insert(
            "architectures".into(),
            serde_json::json!(["PhiForCausalLM"]),
        );
    });
    assert_refused(
        &phi,
        CheckpointFault::Unsupported,
        &["PhiForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM"],
    );
    // The same family with another head has other weights.
    let classifier = edited(LLAMA_2_7B, |map| {
        map.insert(
            "architectures".into(),
            serde_json::json!(["LlamaForSequenceClassification"]),
        );
    });
    assert_refused(
        &classifier,
        CheckpointFault::Unsupported,
        &["LlamaForSequenceClassification"],
    );
}

#[test]
fn another_activation_is_unsupported() {
    assert_refused(
        &edited(MISTRAL_7B_V0_1, |map| {
            map.insert("hidden_act".into(), "gelu".into());
        }),
        CheckpointFault::Unsupported,
        &["hidden_act", "gelu"],
    );
}

#[test]
fn other_rope_scalings_are_unsupported() {
    for rope_type in ["linear", "dynamic", "yarn"] {
        assert_refused(
            &edited(LLAMA_2_7B, |map| {
                map.insert(
                    "rope_scaling".into(),
                    serde_json::json!({"type": rope_type, "factor": 2.0}),
                );
            }),
            CheckpointFault::Unsupported,
            &["rope_scaling", rope_type],
        );
    }
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("rope_scaling".into(), serde_json::json!({"factor": 2.0}));
        }),
        CheckpointFault::Malformed,
        &["rope_scaling", "rope_type"],
    );
    assert_refused(
        &edited(LLAMA_2_7B, |map| {
            map.insert("partial_rotary_factor".into(), 0.5.into());
        }),
        CheckpointFault::Unsupported,
        &["partial_rotary_factor"],
    );
}

#[test]
fn llama3_scaling_needs_its_fields() {
    assert_refused(
        &edited(LLAMA_3_1_8B_INSTRUCT, |map| {
            let scaling = map["rope_scaling"].as_object_mut().unwrap();
            scaling.remove("factor");
            scaling.remove("original_max_position_embeddings");
        }),
        CheckpointFault::Malformed,
        &[
            "rope_scaling.factor",
            "rope_scaling.original_max_position_embeddings",
        ],
    );
}

#[test]
fn llama3_scaling_on_another_family_is_unsupported() {
    let scaling =
        serde_json::from_str::<Value>(LLAMA_3_1_8B_INSTRUCT).unwrap()["rope_scaling"].clone();
    assert_refused(
        &edited(MISTRAL_7B_V0_1, |map| {
            map.insert("rope_scaling".into(), scaling.clone());
        }),
        CheckpointFault::Unsupported,
        &["rope_scaling", "llama3", "mistral"],
    );
    assert_refused(
        &edited(QWEN2_7B_INSTRUCT, |map| {
            map.insert("rope_scaling".into(), scaling.clone());
        }),
        CheckpointFault::Unsupported,
        &["rope_scaling", "qwen2"],
    );
}

#[test]
fn qwen_sliding_windows_are_unsupported() {
    for base in [QWEN2_7B_INSTRUCT, QWEN3_0_6B] {
        assert_refused(
            &edited(base, |map| {
                map.insert("use_sliding_window".into(), true.into());
                map.insert("sliding_window".into(), 4096.into());
            }),
            CheckpointFault::Unsupported,
            &["use_sliding_window", "not implemented", "max_window_layers"],
        );
    }
}

#[test]
fn validate_refuses_unusable_sizes() {
    let cases: [(&str, Value, &str); 8] = [
        ("num_key_value_heads", 5.into(), "num_key_value_heads"),
        ("head_dim", 127.into(), "head_dim"),
        ("rms_norm_eps", 0.0.into(), "rms_norm_eps"),
        ("rope_theta", (-1.0).into(), "rope_theta"),
        ("intermediate_size", 0.into(), "intermediate_size"),
        ("vocab_size", 0.into(), "vocab_size"),
        ("num_attention_heads", 0.into(), "num_attention_heads"),
        (
            "max_position_embeddings",
            0.into(),
            "max_position_embeddings",
        ),
    ];
    for (key, value, named) in cases {
        assert_refused(
            &edited(LLAMA_2_7B, |map| {
                map.insert(key.into(), value);
            }),
            CheckpointFault::Malformed,
            &[named],
        );
    }
    assert_refused(
        &edited(MISTRAL_7B_V0_1, |map| {
            map.insert("sliding_window".into(), 0.into());
        }),
        CheckpointFault::Malformed,
        &["sliding_window"],
    );
    for (key, value) in [
        ("factor", Value::from(0.5)),
        ("low_freq_factor", 4.0.into()),
        ("high_freq_factor", 1.0.into()),
        ("original_max_position_embeddings", 0.into()),
    ] {
        assert_refused(
            &edited(LLAMA_3_1_8B_INSTRUCT, |map| {
                map["rope_scaling"]
                    .as_object_mut()
                    .unwrap()
                    .insert(key.into(), value);
            }),
            CheckpointFault::Malformed,
            &[&format!("rope_scaling.{key}")],
        );
    }
    // Several faults at once are all named.
    let mut config = parse(LLAMA_2_7B);
    config.head_dim = 0;
    config.rms_norm_eps = f64::NAN;
    match config.validate(path()) {
        Err(Error::Checkpoint {
            fault: CheckpointFault::Malformed,
            why,
            ..
        }) => assert!(
            why.contains("head_dim") && why.contains("rms_norm_eps"),
            "{why}"
        ),
        other => panic!("expected Malformed, got {other:?}"),
    }
    assert!(parse(LLAMA_2_7B).validate(path()).is_ok());
}

/// mistralai/Mixtral-8x7B-v0.1's config.json.
const MIXTRAL_8X7B: &str = r#"{
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}"#;

/// Qwen/Qwen3-30B-A3B's config.json.
const QWEN3_30B_A3B: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

#[test]
fn mixtral_8x7b() {
    let config = parse(MIXTRAL_8X7B);
    assert_eq!(config.family, Family::Mixtral);
    assert_eq!(
        (config.sliding_window, config.qkv_bias, config.qk_norm),
        (None, false, false)
    );
    let experts = config.experts.clone().unwrap();
    assert_eq!(
        experts,
        ExpertsConfig {
            experts: 8,
            experts_per_token: 2,
            expert_intermediate_size: 14336,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            dense_layers: Vec::new(),
        }
    );
    assert!((0..32).all(|layer| experts.is_sparse(layer)));
}

#[test]
fn qwen3_30b_a3b() {
    let config = parse(QWEN3_30B_A3B);
    assert_eq!(config.family, Family::Qwen3Moe);
    assert_eq!((config.head_dim, config.qk_norm), (128, true));
    let experts = config.experts.unwrap();
    assert_eq!(
        (
            experts.experts,
            experts.experts_per_token,
            experts.expert_intermediate_size
        ),
        (128, 8, 768)
    );
    assert!(experts.norm_topk_prob);
    // Dense layers from the step and the list.
    let sparse = parse(&edited(QWEN3_30B_A3B, |map| {
        map.insert("decoder_sparse_step".into(), 2.into());
        map.insert("mlp_only_layers".into(), serde_json::json!([3]));
        map.remove("norm_topk_prob");
    }));
    let experts = sparse.experts.unwrap();
    assert!(!experts.norm_topk_prob, "transformers' default is false");
    let layers: Vec<bool> = (0..6).map(|l| experts.is_sparse(l)).collect();
    assert_eq!(layers, [false, true, false, false, false, true]);
}

#[test]
fn mixtures_of_experts_refuse_unusable_sizes() {
    let too_many = edited(MIXTRAL_8X7B, |map| {
        map.insert("num_experts_per_tok".into(), 9.into());
    });
    assert_refused(
        &too_many,
        CheckpointFault::Malformed,
        &["num_experts_per_tok", "num_local_experts"],
    );
    let none = edited(QWEN3_30B_A3B, |map| {
        map.insert("num_experts".into(), 0.into());
        map.insert("decoder_sparse_step".into(), 0.into());
    });
    assert_refused(
        &none,
        CheckpointFault::Malformed,
        &["num_experts is 0", "decoder_sparse_step is 0"],
    );
    let bad_list = edited(QWEN3_30B_A3B, |map| {
        map.insert("mlp_only_layers".into(), serde_json::json!(["1"]));
    });
    assert_refused(
        &bad_list,
        CheckpointFault::Malformed,
        &["mlp_only_layers[0]"],
    );
}
