// Validation of index values, shared by the plan (which also counts rows) and gather_rows.
// Compiled only in translation units without ISA flags.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "scatter_add/scatter_add.h"

namespace scatter_add {
namespace cpu {

// Throws Error(index) naming the first value outside [0, n) that is not ignore; counts[v] is
// incremented for each kept value and ignored collects positions equal to ignore (either may be
// null).
template <class I>
void check_index_values(const I* idx, int64_t k, int64_t n, std::optional<int64_t> ignore,
                        std::vector<int64_t>* counts, std::vector<int64_t>* ignored) {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t v = static_cast<int64_t>(idx[i]);
    if (ignore && v == *ignore) {
      if (ignored != nullptr) ignored->push_back(i);
      continue;
    }
    if (v < 0 || v >= n) {
      std::string msg = "index[" + std::to_string(i) + "] = " + std::to_string(v) +
                        " is out of range for " + std::to_string(n) + " rows (valid: 0.." +
                        std::to_string(n - 1) + ")";
      if (ignore) msg += " and is not ignore_index = " + std::to_string(*ignore);
      throw Error(Error::Kind::index, msg);
    }
    if (counts != nullptr) ++(*counts)[static_cast<size_t>(v)];
  }
}

}  // namespace cpu
}  // namespace scatter_add
