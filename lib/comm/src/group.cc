// groupRank, the default Communicator::allocate and detail::rankList: their own file because the NCCL plugin
// (libdtrain_comm_nccl.so) compiles it in too, so the plugin needs nothing from dtrain_comm
// and loads into any executable.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "detail/rank_list.h"
#include "dtrain/comm/communicator.h"
#include "dtrain/common/errors.h"

namespace dtrain::comm {
namespace {

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(size_t bytes) : data_(bytes) {}
  void* data() override { return data_.data(); }
  size_t bytes() const override { return data_.size(); }
  void upload(const void* host, size_t n) override { std::memcpy(data_.data(), host, std::min(n, data_.size())); }
  void download(void* host, size_t n) const override { std::memcpy(host, data_.data(), std::min(n, data_.size())); }

 private:
  std::vector<char> data_;
};

}  // namespace

namespace detail {

std::string rankList(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += fmt::format("{}{}", out.empty() ? "" : ", ",
                       i == j ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]));
    i = j + 1;
  }
  return out;
}

}  // namespace detail

std::unique_ptr<Buffer> Communicator::allocate(size_t bytes) { return std::make_unique<HostBuffer>(bytes); }

int groupRank(const std::vector<int>& ranks, int rank, int size, const std::string& name) {
  if (name.empty()) throw SpecError("communicator group: the name is empty; give every group its own name");
  if (ranks.empty()) throw SpecError(fmt::format("communicator group \"{}\": the rank list is empty", name));
  std::vector<bool> seen(static_cast<size_t>(size), false);
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= size)
      throw SpecError(fmt::format(
          "communicator group \"{}\": rank {} is not a rank of the parent communicator (size {})", name, r, size));
    if (seen[static_cast<size_t>(r)])
      throw SpecError(fmt::format("communicator group \"{}\": rank {} is listed twice", name, r));
    seen[static_cast<size_t>(r)] = true;
    if (r == rank) mine = static_cast<int>(i);
  }
  if (mine < 0)
    throw SpecError(
        fmt::format("communicator group \"{}\": rank {} is not in it ({}); only the listed ranks may create it", name,
                    rank, fmt::join(ranks, ", ")));
  return mine;
}

}  // namespace dtrain::comm
