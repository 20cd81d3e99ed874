#pragma once
// Rank lists for messages. Defined in group.cc, which the NCCL plugin compiles in too.
#include <string>
#include <vector>

namespace dtrain::comm::detail {

// "0-3, 6, 9-10": runs of consecutive ranks as ranges, in the given order.
std::string rankList(const std::vector<int>& ranks);

}  // namespace dtrain::comm::detail
