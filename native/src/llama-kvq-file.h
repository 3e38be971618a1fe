#pragma once

// A file written under a temporary name beside its destination and renamed into place only once complete: a
// failed or interrupted save (a state that cannot be saved, a full disk) leaves the caller's old file as it was
// and no half-written one.

#include <string>

struct llama_kvq_atomic_file {
    explicit llama_kvq_atomic_file(const char * dest);
    ~llama_kvq_atomic_file();

    llama_kvq_atomic_file(const llama_kvq_atomic_file &) = delete;
    llama_kvq_atomic_file & operator=(const llama_kvq_atomic_file &) = delete;

    // where to write
    const char * path() const { return part.c_str(); }

    // the written file replaces the destination; false (and logged) when the rename fails
    bool commit();

private:
    std::string dest;
    std::string part;
    bool        committed = false;
};
