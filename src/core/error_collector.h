// Runs the checks of an object's parts and reports all they raised: each
// part is drained (its own check() clears what it reports), the first error
// is thrown again as its own type with the others named in its message. For
// the check() of objects made of parts (MoELayer, Model), so that no part's
// error outlives the check() after the call that caused it.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "moelink/errors.h"

namespace moelink::detail {

class ErrorCollector {
 public:
  template <class Check>
  void take(Check&& check) {
    try {
      check();
    } catch (const Error& e) {
      if (!first_) first_ = std::current_exception();
      messages_.emplace_back(e.what());
    }
  }

  // Throws the first error (its type kept; the others appended), if any.
  void raise() const {
    if (!first_) return;
    if (messages_.size() == 1) std::rethrow_exception(first_);
    std::string all = messages_[0] + " [and " + std::to_string(messages_.size() - 1) +
                      " more reported since the last check(): ";
    for (size_t i = 1; i < messages_.size(); ++i) all += (i > 1 ? "; " : "") + messages_[i];
    all += "]";
    try {
      std::rethrow_exception(first_);
    } catch (const TimeoutError&) {
      throw TimeoutError(all);
    } catch (const InputError&) {
      throw InputError(all);
    } catch (const InvalidArgument&) {
      throw InvalidArgument(all);
    } catch (const SystemError&) {
      throw SystemError(all);
    } catch (const Error&) {
      throw Error(all);
    }
  }

 private:
  std::exception_ptr first_;
  std::vector<std::string> messages_;
};

}  // namespace moelink::detail
