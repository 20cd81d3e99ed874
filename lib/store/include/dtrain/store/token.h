#pragma once
#include <string>

namespace dtrain::store {

// A fresh job token: 32 random bytes, hex-encoded.
std::string newToken();

// Reads a token file (trailing whitespace stripped). Refuses files others can read, since
// the token is the job's only secret. Throws SpecError naming the file and the fix.
std::string readTokenFile(const std::string& path);

// Writes a new token to `path` with mode 0600 and returns it.
std::string createTokenFile(const std::string& path);

}  // namespace dtrain::store
