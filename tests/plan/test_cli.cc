// moelink-plan's command line: every bad value is a usage error (exit 2) naming
// the option, the value and the allowed range with its unit; sweeps list what
// they leave out; several GPU types share one sweep.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "plan_test_util.h"

using namespace moelink::plan;
using namespace moelink::plan::test;

namespace {
bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }
std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream ss(s);
  for (std::string l; std::getline(ss, l);) v.push_back(l);
  return v;
}
}  // namespace

// Issue 1: "--sweep-batch 0,-1 --csv -" exited 0 with rows of batch -1.
TEST(PlanCli, SweepValuesAreValidated) {
  CliRun r = run_split("--sweep --sweep-batch 0,-1 --csv -");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(r.out, "") << "no CSV rows for a bad sweep";
  EXPECT_TRUE(has(r.err, "--sweep-batch: 0 is out of range; allowed: 1 to 65,536 (requests per DP group)")) << r.err;
  r = run_split("--sweep --sweep-batch 4,-1 --csv -");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.err, "--sweep-batch: -1 is out of range; allowed: 1 to 65,536 (requests per DP group)")) << r.err;
  r = run("--sweep --sweep-ep 8,0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "--sweep-ep: 0 is out of range; allowed: 1 to 4,096 (GPUs)")) << r.out;
  r = run("--sweep --sweep-tp 1,two");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "--sweep-tp: 'two' is not an integer; allowed: 1 to 1,024 (GPUs per DP group)")) << r.out;
  r = run("--sweep --sweep-batch 1,2 --csv -");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const auto& l : lines(r.out)) EXPECT_FALSE(has(l, ",-")) << l;  // no negative values
}

// Issue 2: "--batch abc" exited 104 (CLI11's code); docs/planner.md documents 2.
TEST(PlanCli, UsageErrorsExit2) {
  CliRun r = run("--batch abc");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "moelink-plan: error: --batch: 'abc' is not an integer; allowed: 1 to 65,536 "
                         "(requests per DP group)"))
      << r.out;
  for (const char* args : {"--bogus", "--ep", "stray-argument", "--ep 1.5", "--acceptance high", "--ep 8 --ep"}) {
    r = run(args);
    EXPECT_EQ(r.rc, 2) << args << ": " << r.out;
    EXPECT_TRUE(has(r.out, "moelink-plan: error: ")) << args << ": " << r.out;
  }
  EXPECT_EQ(run("--help").rc, 0);
  EXPECT_EQ(run("--version").rc, 0);
}

// Issue 3: one combined sentence for all range errors; now each option on its own.
TEST(PlanCli, EachOptionNamedWithValueRangeAndUnit) {
  struct Case {
    const char* args;
    const char* message;
  };
  const Case cases[] = {
      {"--ep 0", "--ep: 0 is out of range; allowed: 1 to 4,096 (GPUs)"},
      {"--dp 0", "--dp: 0 is out of range; allowed: 1 to 4,096 (DP groups)"},
      {"--tp -2", "--tp: -2 is out of range; allowed: 1 to 1,024 (GPUs per DP group)"},
      {"--batch 0", "--batch: 0 is out of range; allowed: 1 to 65,536 (requests per DP group)"},
      {"-b 70000", "--batch: 70000 is out of range; allowed: 1 to 65,536 (requests per DP group)"},
      {"--kv-len -1", "--kv-len: -1 is out of range; allowed: 0 to 10,000,000 (tokens per request)"},
      {"--mtp 17", "--mtp: 17 is out of range; allowed: 0 to 16 (draft tokens per step)"},
      {"--acceptance 1.5", "--acceptance: 1.5 is out of range; allowed: 0 to 1 (fraction of draft tokens accepted)"},
      {"--sweep --target -5", "--target: -5 is out of range; allowed: 0 to 100,000 (tok/s per request; 0 = no target)"},
      {"--overlap sometimes", "--overlap: unknown overlap mode 'sometimes'; valid: none, dispatch, microbatch"},
      {"--ep 8 --tp 3", "--tp 3 does not divide --ep 8; allowed: a divisor of EP (1, 2, 4, 8) GPUs per DP group"},
      {"--ep 8 --dp 2 --tp 2", "--dp 2 x --tp 2 = 4 GPUs, but --ep is 8; allowed: --dp 4 (EP / TP) DP groups"},
      {"--ep 7", "layout EP7 DP7 TP1 (--ep 7, --tp 1): the 256 experts of DeepSeek-V3 are not divisible by EP 7"},
      {"--gpu b200", "--gpu: unknown gpu 'b200'; valid: h100, h200, h800"},
      {"--model gpt-5", "--model: unknown model 'gpt-5'"},
      {"--network pigeon", "--network: unknown network 'pigeon'"},
      {"--target 50", "--target requires --sweep"},
      {"--sweep-ep 8", "--sweep-ep requires --sweep"},
  };
  for (const auto& c : cases) {
    CliRun r = run(c.args);
    EXPECT_EQ(r.rc, 2) << c.args;
    EXPECT_TRUE(has(r.out, c.message)) << c.args << "\n" << r.out;
  }
  // The old combined sentence is gone.
  EXPECT_FALSE(has(run("--batch 0").out, "need batch >= 1, kv-len >= 0"));
}

// Issue 4: --gpus-per-node 0 or -3 was silently replaced by 8.
TEST(PlanCli, GpusPerNodeIsChecked) {
  for (const char* v : {"0", "-3", "1025"}) {
    CliRun r = run(std::string("--gpus-per-node ") + v);
    EXPECT_EQ(r.rc, 2) << v;
    EXPECT_TRUE(has(r.out, std::string("--gpus-per-node: ") + v +
                               " is out of range; allowed: 1 to 1,024 (GPUs per node)"))
        << r.out;
  }
  CliRun r = run("--ep 8 --gpus-per-node 4 --batch 8 --json -");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["layout"]["gpus_per_node"], 4);
  EXPECT_EQ(j["layout"]["nodes"], 2);
  EXPECT_EQ(j["network"], "ib-cx7");  // two nodes: the default network leaves NVLink
}

// Issue 5: layouts a sweep leaves out are listed with the reason.
TEST(PlanCli, SweepListsLeftOutLayouts) {
  CliRun r = run_split("--sweep --gpu h100 --sweep-ep 8,128 --sweep-batch 1,64");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "Left out of the sweep (4):")) << r.out;
  EXPECT_TRUE(has(r.out, "  EP8 DP8 TP1 on H100-SXM: does not fit in memory: weights + reserve alone need "))
      << r.out;
  EXPECT_TRUE(has(r.out, "GB > 80.0 GB per GPU")) << r.out;
  r = run_split("--sweep --sweep-ep 7,8 --sweep-batch 1,128");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(has(r.out, "EP7 (every TP) on H200-SXM: the 256 experts of DeepSeek-V3 are not divisible by EP 7"))
      << r.out;
  EXPECT_TRUE(has(r.out, "EP8 DP8 TP1 on H200-SXM: batch 128 left out (memory): batch 128 needs ")) << r.out;
  EXPECT_TRUE(has(r.out, "at most 121 requests per DP group fit")) << r.out;
  // With JSON on stdout the list goes to stderr and into the JSON.
  r = run_split("--sweep --sweep-ep 7,8 --sweep-batch 1,128 --json -");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["skipped"].size(), 2u) << j["skipped"].dump();
  EXPECT_EQ(j["skipped"][0]["ep"], 7);
  EXPECT_EQ(j["skipped"][0]["tp"], 0);
  EXPECT_TRUE(has(j["skipped"][0]["reason"].get<std::string>(), "not divisible by EP 7"));
  EXPECT_EQ(j["skipped"][1]["batches"], nlohmann::json::array({128}));
  EXPECT_FALSE(j["skipped"][1]["whole_layout"].get<bool>());
  EXPECT_TRUE(has(r.err, "moelink-plan: note: Left out of the sweep (2):")) << r.err;
  // CSV on stdout stays CSV.
  r = run_split("--sweep --sweep-ep 7,8 --sweep-batch 1,128 --csv -");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_FALSE(has(r.out, "Left out")) << r.out;
  EXPECT_TRUE(has(r.err, "EP7 (every TP)")) << r.err;
  // Nothing left: an error that still says why.
  r = run("--sweep --sweep-ep 7");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "no swept layout is valid and fits in memory")) << r.out;
  EXPECT_TRUE(has(r.out, "EP7 (every TP) on H200-SXM: the 256 experts")) << r.out;
}

// Issue 6: --help gives the unit of every option.
TEST(PlanCli, HelpGivesUnits) {
  CliRun r = run("--help");
  ASSERT_EQ(r.rc, 0);
  const std::pair<const char*, const char*> units[] = {
      {"--profiles-dir", "directory"},       {"--model", "config.json"},
      {"--gpu", "TFLOP/s, HBM GB and GB/s"}, {"--network", "GB/s per GPU, latency us"},
      {"--ep", "(GPUs)"},                    {"--dp", "(DP groups)"},
      {"--tp", "(GPUs per DP group)"},       {"--gpus-per-node", "(GPUs per node)"},
      {"--batch", "(requests per DP group)"}, {"--kv-len", "(tokens per request)"},
      {"--mtp", "(draft tokens per step)"},  {"--acceptance", "(fraction of draft tokens accepted)"},
      {"--overlap", "none | dispatch | microbatch"}, {"--calibrate", "latencies, us"},
      {"--sweep-gpu", "GPU profiles"},       {"--sweep-ep", "(GPUs)"},
      {"--sweep-tp", "(GPUs per DP group)"}, {"--sweep-batch", "(requests per DP group)"},
      {"--target", "tok/s per request"},     {"--json", "times in us, speeds in tok/s"},
      {"--csv", "same units as --json"},     {"--svg-dir", "directory"},
      {"--ignore-memory", "HBM (GB)"},       {"--sweep", "tok/s"}};
  for (const auto& [opt, unit] : units) {
    // The option's help entry: from its name to the next option.
    size_t at = r.out.find("\n  " + std::string(opt) + " ");
    if (at == std::string::npos) at = r.out.find("," + std::string(opt) + " ");  // "-b,--batch"
    ASSERT_NE(at, std::string::npos) << opt;
    const size_t next = r.out.find("\n  -", at + 1);
    const std::string entry = r.out.substr(at, next - at);
    EXPECT_TRUE(has(entry, unit)) << opt << ": " << entry;
  }
}

// Issue 7: several GPU types in one sweep, one CSV / JSON / Pareto chart.
TEST(PlanCli, SweepOverSeveralGpus) {
  const std::string sweep = "--sweep --sweep-gpu h100,h200 --sweep-ep 8,128 --sweep-batch 1,16,64";
  CliRun r = run_split(sweep + " --csv -");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto rows = lines(r.out);
  ASSERT_GT(rows.size(), 1u);
  EXPECT_EQ(rows[0].substr(0, 29), "ep,dp,tp,batch,overlap,gpu,ou");
  std::set<std::string> gpus, frontier_gpus;
  for (size_t i = 1; i < rows.size(); ++i) {
    std::vector<std::string> f;
    std::stringstream ss(rows[i]);
    for (std::string c; std::getline(ss, c, ',');) f.push_back(c);
    ASSERT_EQ(f.size(), 13u) << rows[i];
    gpus.insert(f[5]);
    if (f[12] == "1") frontier_gpus.insert(f[5] + " EP" + f[0]);
    EXPECT_FALSE(f[5] == "H100-SXM" && f[0] == "8") << "EP8 does not fit on H100: " << rows[i];
  }
  EXPECT_EQ(gpus, (std::set<std::string>{"H100-SXM", "H200-SXM"}));
  EXPECT_EQ(frontier_gpus, (std::set<std::string>{"H100-SXM EP128", "H200-SXM EP8", "H200-SXM EP128"}));
  EXPECT_TRUE(has(r.err, "EP8 DP8 TP1 on H100-SXM: does not fit")) << r.err;

  r = run_split(sweep + " --json -");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["frontiers"].contains("EP128 on H100-SXM"));
  EXPECT_TRUE(j["frontiers"].contains("EP8 on H200-SXM"));
  EXPECT_TRUE(j["frontiers"].contains("EP128 on H200-SXM"));

  const auto dir = scratch_dir("multi_gpu");
  r = run(sweep + " --target 60 --svg-dir " + dir.string());
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(has(r.out, "DeepSeek-V3 on H100-SXM and H200-SXM")) << r.out;
  EXPECT_TRUE(has(r.out, "\nEP128 on H100-SXM\n")) << r.out;
  EXPECT_TRUE(has(r.out, "\nEP8 on H200-SXM\n")) << r.out;
  EXPECT_TRUE(has(r.out, " on H") && has(r.out, "best at >= 60 tok/s: EP")) << r.out;
  const std::string svg = read_text_file((dir / "pareto.svg").string());
  EXPECT_TRUE(has(svg, "EP128 (H100-SXM)"));
  EXPECT_TRUE(has(svg, "EP8 (H200-SXM)"));
  EXPECT_TRUE(has(svg, "H100-SXM vs H200-SXM"));
  std::filesystem::remove_all(dir);

  // --gpu takes one type and points to --sweep-gpu; --sweep-gpu needs --sweep and known names.
  r = run("--gpu h100,h200");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "--gpu: 'h100,h200' names several GPUs")) << r.out;
  EXPECT_TRUE(has(r.out, "--sweep --sweep-gpu h100,h200")) << r.out;
  r = run("--sweep-gpu h100,h200");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "--sweep-gpu requires --sweep")) << r.out;
  r = run("--sweep --sweep-gpu h100,b200");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "--sweep-gpu: unknown gpu 'b200'; valid: h100, h200, h800")) << r.out;
}

// Issue 9: the H200's measured capacity moves EP8 TP1 from 96 to 121 requests.
TEST(PlanCli, H200BatchLimitFollowsMeasuredMemory) {
  EXPECT_EQ(run("--ep 8 --batch 121").rc, 0);
  CliRun r = run("--ep 8 --batch 122");
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(has(r.out, "has 150.1 GB")) << r.out;
  EXPECT_TRUE(has(r.out, "at most 121 requests per DP group fit")) << r.out;
}
