#pragma once
#include <string>

namespace dtrain::store {

// A fresh job token: 32 random bytes, hex-encoded.
std::string newToken();

// The shortest token a user may give (a file, DTRAIN_STORE_TOKEN): a shorter one can be
// guessed. dtrain's own tokens are 64 characters.
inline constexpr size_t kMinTokenLength = 16;

// Throws SpecError when `token` is shorter than kMinTokenLength: "<where>: the token is N
// characters; a token must have at least 16 (...); <fix>".
void checkTokenStrength(const std::string& token, const std::string& where, const std::string& fix);

// Reads a token file (trailing whitespace stripped). Refuses files others can read, since
// the token is the job's only secret, and tokens shorter than kMinTokenLength. Throws
// SpecError naming the file and the fix.
std::string readTokenFile(const std::string& path);

// Writes a new token to `path` with mode 0600 and returns it.
std::string createTokenFile(const std::string& path);

}  // namespace dtrain::store
