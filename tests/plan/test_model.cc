#include <gtest/gtest.h>

#include "plan_test_util.h"

using namespace moelink::plan;
using moelink::plan::test::store;

TEST(PlanModel, DeepSeekV3Numbers) {
  ModelSpec m = store().model("deepseek-v3");
  EXPECT_EQ(m.attention, AttentionKind::kMLA);
  EXPECT_DOUBLE_EQ(m.kv_bytes_per_token(), 70272.0);  // 61 x (512 + 64) x 2
  EXPECT_EQ(m.num_moe_layers(), 58);
  EXPECT_DOUBLE_EQ(m.weight_bytes, 1.0);
  EXPECT_EQ(m.quant_block, 128);
  EXPECT_NEAR(m.total_params() / 1e9, 671, 10);     // 671B total
  EXPECT_NEAR(m.activated_params() / 1e9, 37, 2);   // 37B activated
}

TEST(PlanModel, AllBuiltInsParse) {
  auto s = store();
  std::vector<std::string> names = s.models();
  ASSERT_GE(names.size(), 4u);
  for (const auto& n : names) EXPECT_NO_THROW(s.model(n)) << n;
  EXPECT_NEAR(s.model("Kimi-K2").total_params() / 1e9, 1030, 40);
  EXPECT_NEAR(s.model("qwen3-235b-a22b").total_params() / 1e9, 235, 5);
  EXPECT_NEAR(s.model("mixtral-8x7b").total_params() / 1e9, 46.7, 1);
  EXPECT_DOUBLE_EQ(s.model("mixtral-8x7b").kv_bytes_per_token(), 32 * 2 * 8 * 128 * 2);
}

TEST(PlanModel, HuggingFaceConfig) {
  const char* cfg = R"({"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 4, "vocab_size": 1000, "num_experts": 64, "num_experts_per_tok": 4,
    "moe_intermediate_size": 1024, "intermediate_size": 4096, "torch_dtype": "bfloat16"})";
  ModelSpec m = model_from_json_text(cfg, "tiny");
  EXPECT_EQ(m.name, "tiny");
  EXPECT_EQ(m.attention, AttentionKind::kGQA);
  EXPECT_EQ(m.head_dim, 128);
  EXPECT_DOUBLE_EQ(m.weight_bytes, 2);
  EXPECT_DOUBLE_EQ(m.kv_bytes_per_token(), 24.0 * 2 * 4 * 128 * 2);
}

TEST(PlanModel, ErrorsNameTheProblem) {
  auto s = store();
  try {
    s.model("gpt-5");
    FAIL();
  } catch (const PlanError& e) {
    std::string w = e.what();
    EXPECT_NE(w.find("unknown model 'gpt-5'"), std::string::npos) << w;
    EXPECT_NE(w.find("deepseek-v3"), std::string::npos) << w;
    EXPECT_NE(w.find("mixtral-8x7b"), std::string::npos) << w;
  }
  try {
    s.gpu("a100");
    FAIL();
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("h100, h200, h800"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.network("carrier-pigeon"), PlanError);
  EXPECT_THROW(model_from_json_text("{\"hidden_size\": 10}", "x"), PlanError);  // not MoE
  EXPECT_THROW(model_from_json_text("{not json", "x"), PlanError);
  EXPECT_THROW(gpu_from_json_text("{\"name\": \"g\"}", "g"), PlanError);
  EXPECT_THROW(s.model("/nonexistent/config.json"), PlanError);
}

TEST(PlanModel, LayoutValidation) {
  auto s = store();
  ModelSpec m = s.model("deepseek-v3");
  NetworkProfile nv = s.network("nvlink"), ib = s.network("ib-cx7");
  EXPECT_NO_THROW(validate({8, 8, 1, 8}, m, nv));
  EXPECT_THROW(validate({8, 4, 1, 8}, m, nv), PlanError);    // EP != DP x TP
  EXPECT_THROW(validate({16, 16, 1, 8}, m, nv), PlanError);  // two nodes over NVLink only
  EXPECT_NO_THROW(validate({16, 16, 1, 8}, m, ib));
  EXPECT_THROW(validate({48, 48, 1, 8}, m, ib), PlanError);  // 256 % 48
  EXPECT_THROW(validate({16, 1, 16, 8}, m, ib), PlanError);  // TP beyond a node
  EXPECT_THROW(overlap_from_string("sometimes"), PlanError);
  EXPECT_EQ(overlap_from_string("microbatch"), OverlapMode::kMicroBatch);
}
