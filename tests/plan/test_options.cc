// The CLI's value checks: every message names the value, the range and the unit.
#include <gtest/gtest.h>

#include "moelink/plan/options.h"

using namespace moelink::plan;

TEST(PlanOptions, IntegersInRange) {
  const IntRange batch{1, 65536, "requests per DP group"};
  EXPECT_EQ(batch.str(), "1 to 65,536 (requests per DP group)");
  EXPECT_EQ(check_int("1", batch), "");
  EXPECT_EQ(check_int("65536", batch), "");
  EXPECT_EQ(check_int("+8", batch), "");
  EXPECT_EQ(check_int(" 16", batch), "");  // "--sweep-batch '8, 16'"
  EXPECT_EQ(check_int("0", batch), "0 is out of range; allowed: 1 to 65,536 (requests per DP group)");
  EXPECT_EQ(check_int("-1", batch), "-1 is out of range; allowed: 1 to 65,536 (requests per DP group)");
  EXPECT_EQ(check_int("65537", batch), "65537 is out of range; allowed: 1 to 65,536 (requests per DP group)");
  EXPECT_EQ(check_int("99999999999999999999", batch),
            "99999999999999999999 is out of range; allowed: 1 to 65,536 (requests per DP group)");
  for (const char* bad : {"abc", "", "1.5", "1e3", "8x", "0x10", "+-5", "--1"})
    EXPECT_EQ(check_int(bad, batch),
              "'" + std::string(bad) + "' is not an integer; allowed: 1 to 65,536 (requests per DP group)")
        << bad;
}

TEST(PlanOptions, RealsInRange) {
  const RealRange acc{0, 1, "fraction of draft tokens accepted"};
  EXPECT_EQ(acc.str(), "0 to 1 (fraction of draft tokens accepted)");
  EXPECT_EQ(check_real("0.6", acc), "");
  EXPECT_EQ(check_real("1", acc), "");
  EXPECT_EQ(check_real("0", acc), "");
  EXPECT_EQ(check_real("1.5", acc), "1.5 is out of range; allowed: 0 to 1 (fraction of draft tokens accepted)");
  EXPECT_EQ(check_real("-0.1", acc), "-0.1 is out of range; allowed: 0 to 1 (fraction of draft tokens accepted)");
  EXPECT_EQ(check_real("inf", acc), "inf is out of range; allowed: 0 to 1 (fraction of draft tokens accepted)");
  for (const char* bad : {"nan", "x", "", "0.5.1", "1,5"})
    EXPECT_EQ(check_real(bad, acc),
              "'" + std::string(bad) + "' is not a number; allowed: 0 to 1 (fraction of draft tokens accepted)")
        << bad;
  EXPECT_EQ((RealRange{0, 100000, "tok/s"}).str(), "0 to 100,000 (tok/s)");
  EXPECT_EQ((RealRange{0.5, 2.25, "x"}).str(), "0.5 to 2.25 (x)");
}

TEST(PlanOptions, ThousandsSeparators) {
  EXPECT_EQ(with_thousands(0), "0");
  EXPECT_EQ(with_thousands(999), "999");
  EXPECT_EQ(with_thousands(1000), "1,000");
  EXPECT_EQ(with_thousands(100000), "100,000");
  EXPECT_EQ(with_thousands(1234567), "1,234,567");
  EXPECT_EQ(with_thousands(-4096), "-4,096");
}
