// The setup-time bootstrap: TCP all_gather across processes, the
// torchrun-style environment bootstrap's errors, and timeouts that name the
// rank that never showed up.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "moelink/moelink.h"
#include "rank_harness.h"

namespace moelink_test {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// True when `msg` names rank r, alone or in a list: "rank 2", "rank(s) 1, 2".
bool names_rank(const std::string& msg, int r) {
  const std::regex re("rank(\\(s\\))?\\s+([0-9]+,\\s*)*" + std::to_string(r) + "\\b");
  return std::regex_search(msg, re);
}

std::vector<char> contribution(int rank, size_t bytes) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>(rank * 31 + i * 7 + (i >> 9));
  return v;
}

TEST(TcpBootstrap, AllGatherOfThreeRanksReturnsEveryContributionInRankOrder) {
  run_ranks(3, [](int rank, moelink::Bootstrap& bs) {
    RANK_CHECK(bs.rank() == rank);
    RANK_CHECK(bs.world_size() == 3);
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, size_t{3} << 20}) {
      const std::vector<char> in = contribution(rank, bytes);
      std::vector<char> out(3 * bytes + 1, 'Z');  // one extra byte must stay untouched
      bs.all_gather(in.data(), out.data(), bytes);
      for (int r = 0; r < 3; ++r)
        RANK_CHECK(std::equal(out.begin() + r * bytes, out.begin() + (r + 1) * bytes,
                              contribution(r, bytes).begin()))
            << "all_gather of " << bytes << " bytes: rank " << r << "'s part is wrong";
      RANK_CHECK(out.back() == 'Z') << "all_gather wrote past world_size * bytes";
    }
    // The vector overload and barrier.
    std::vector<char> mine(5, static_cast<char>('a' + rank));
    std::vector<char> all = bs.all_gather(mine);
    RANK_CHECK(all == std::vector<char>({'a', 'a', 'a', 'a', 'a', 'b', 'b', 'b', 'b', 'b', 'c',
                                         'c', 'c', 'c', 'c'}))
        << std::string(all.begin(), all.end());
    bs.barrier();
  }, 120);
}

TEST(TcpBootstrap, AllGatherWithDifferentSizesThrowsInvalidArgumentOnEveryRank) {
  run_ranks(3, [](int rank, moelink::Bootstrap& bs) {
    std::vector<char> in(rank == 2 ? 9 : 8), out(3 * 9);
    expect_throw_naming<moelink::InvalidArgument>(
        [&] { bs.all_gather(in.data(), out.data(), in.size()); }, {"rank 2", "9"},
        "all_gather with rank 2 passing 9 bytes");
  }, 120);
}

TEST(TcpBootstrap, MissingRankIsNamedInTimeoutErrorWithinDeadline) {
  const double timeout = 2.0;
  run_processes(3, [&](int rank, int port) {
    if (rank == 2) return;  // never shows up
    const auto start = Clock::now();
    try {
      auto bs = moelink::make_tcp_bootstrap(rank, 3, "127.0.0.1", port, timeout);
      // Rank 1 got in; rank 0 gives up on rank 2, so rank 1's next
      // collective must fail too (rank 0 is gone) instead of hanging.
      bs->barrier();
      RANK_FAIL() << "rank " << rank << ": the barrier succeeded without rank 2";
    } catch (const moelink::TimeoutError& e) {
      if (rank == 0) {
        RANK_CHECK(names_rank(e.what(), 2)) << "rank 0's TimeoutError does not name rank 2: "
                                            << e.what();
      }
    } catch (const moelink::Error& e) {
      RANK_CHECK(rank == 1) << "rank 0 threw " << typeid(e).name() << " instead of TimeoutError: "
                            << e.what();
    }
    RANK_CHECK(seconds_since(start) < 2 * timeout + 5)
        << "rank " << rank << " took " << seconds_since(start) << " s to give up";
  }, 60);
}

TEST(TcpBootstrap, MissingRankZeroIsNamedInTimeoutErrorWithinDeadline) {
  const double timeout = 2.0;
  run_processes(2, [&](int rank, int port) {
    if (rank == 0) return;  // nobody listens
    const auto start = Clock::now();
    expect_throw_naming<moelink::TimeoutError>(
        [&] { moelink::make_tcp_bootstrap(rank, 2, "127.0.0.1", port, timeout); }, {"rank 0"},
        "rank 1 connecting to a rank 0 that never listens");
    RANK_CHECK(seconds_since(start) < timeout + 3) << "took " << seconds_since(start) << " s";
  }, 60);
}

TEST(TcpBootstrap, RankStalledInCollectiveIsNamedInTimeoutError) {
  const double timeout = 2.0;
  run_processes(3, [&](int rank, int port) {
    auto bs = moelink::make_tcp_bootstrap(rank, 3, "127.0.0.1", port, timeout);
    if (rank == 2) {  // alive and connected, but never joins the collective
      std::this_thread::sleep_for(std::chrono::duration<double>(timeout + 1.5));
      return;
    }
    const auto start = Clock::now();
    try {
      bs->barrier();
      RANK_FAIL() << "the barrier succeeded without rank 2";
    } catch (const moelink::TimeoutError& e) {
      if (rank == 0) {
        RANK_CHECK(names_rank(e.what(), 2)) << "TimeoutError does not name rank 2: " << e.what();
      }
    } catch (const moelink::Error& e) {
      RANK_CHECK(rank == 1) << "rank 0 threw " << typeid(e).name() << ": " << e.what();
    }
    RANK_CHECK(seconds_since(start) < timeout + 3) << "took " << seconds_since(start) << " s";
  }, 60);
}

TEST(TcpBootstrap, BadArgumentsThrowInvalidArgument) {
  expect_throw_naming<moelink::InvalidArgument>(
      [] { moelink::make_tcp_bootstrap(2, 2, "127.0.0.1", 29500, 1.0); }, {"rank = 2"}, "rank");
  expect_throw_naming<moelink::InvalidArgument>(
      [] { moelink::make_tcp_bootstrap(0, 0, "127.0.0.1", 29500, 1.0); }, {"world_size = 0"},
      "world_size");
  expect_throw_naming<moelink::InvalidArgument>(
      [] { moelink::make_tcp_bootstrap(0, 2, "127.0.0.1", 0, 1.0); }, {"port = 0"}, "port");
}

// ------------------------------------------------------------ environment

// Sets (or unsets, for nullopt) environment variables for one scope.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, std::optional<std::string>>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name);
      saved_.push_back({name, old ? std::optional<std::string>(old) : std::nullopt});
      set(name, value);
    }
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) set(it->first, it->second);
  }

 private:
  static void set(const char* name, const std::optional<std::string>& v) {
    if (v)
      setenv(name, v->c_str(), 1);
    else
      unsetenv(name);
  }
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

TEST(EnvBootstrap, MissingRankThrowsInvalidArgumentNamingRank) {
  ScopedEnv env({{"RANK", std::nullopt}, {"WORLD_SIZE", "2"}});
  expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                {"RANK", "not set"}, "RANK unset");
}

TEST(EnvBootstrap, EmptyRankThrowsInvalidArgumentNamingRank) {
  ScopedEnv env({{"RANK", ""}, {"WORLD_SIZE", "2"}});
  expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                {"RANK"}, "RANK empty");
}

TEST(EnvBootstrap, MalformedRankThrowsInvalidArgumentNamingRankAndValue) {
  for (const char* bad : {"abc", "1x", "-1", "2", "99999999999999999999"}) {
    ScopedEnv env({{"RANK", bad}, {"WORLD_SIZE", "2"}});
    expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                  {"RANK", bad}, std::string("RANK=") + bad);
  }
}

TEST(EnvBootstrap, MissingOrMalformedWorldSizeThrowsInvalidArgument) {
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", std::nullopt}});
    expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                  {"WORLD_SIZE"}, "WORLD_SIZE unset");
  }
  for (const char* bad : {"0", "two", "-3"}) {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", bad}});
    expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                  {"WORLD_SIZE", bad},
                                                  std::string("WORLD_SIZE=") + bad);
  }
}

TEST(EnvBootstrap, MalformedMasterPortThrowsInvalidArgument) {
  ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}});
  expect_throw_naming<moelink::InvalidArgument>([] { moelink::make_env_bootstrap(1.0); },
                                                {"MASTER_PORT", "70000"}, "MASTER_PORT");
}

TEST(EnvBootstrap, SingleRankFromEnvironmentWorks) {
  ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", std::nullopt}});
  auto bs = moelink::make_env_bootstrap(1.0);
  EXPECT_EQ(bs->rank(), 0);
  EXPECT_EQ(bs->world_size(), 1);
  std::vector<char> v{'x', 'y'};
  EXPECT_EQ(bs->all_gather(v), v);
}

TEST(EnvBootstrap, EnvLocalRankReadsLocalRankOrFallsBack) {
  {
    ScopedEnv env({{"LOCAL_RANK", std::nullopt}});
    EXPECT_EQ(moelink::env_local_rank(5), 5);
  }
  {
    ScopedEnv env({{"LOCAL_RANK", "3"}});
    EXPECT_EQ(moelink::env_local_rank(5), 3);
  }
  {
    ScopedEnv env({{"LOCAL_RANK", "x"}});
    expect_throw_naming<moelink::InvalidArgument>([] { moelink::env_local_rank(0); },
                                                  {"LOCAL_RANK", "x"}, "LOCAL_RANK=x");
  }
}

TEST(EnvBootstrap, TwoRanksFromEnvironmentAllGather) {
  const int port = pick_free_port();
  run_processes(2, [&](int rank, int) {
    ScopedEnv env({{"RANK", std::to_string(rank)},
                   {"WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", std::to_string(port)}});
    auto bs = moelink::make_env_bootstrap(20.0);
    RANK_CHECK(bs->rank() == rank);
    std::vector<char> all = bs->all_gather(std::vector<char>{static_cast<char>('0' + rank)});
    RANK_CHECK(all == std::vector<char>({'0', '1'}));
  }, 60);
}

}  // namespace
}  // namespace moelink_test
