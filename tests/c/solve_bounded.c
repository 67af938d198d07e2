/*
 * mucudnnSolveProfile on one profile file, in a process of its own: tests/c_abi.rs runs it
 * under an address-space limit, where a solver that allocated per row of a huge extent
 * aborted the caller. Prints the status and the last error; exit status 0 when the call
 * returned (whatever its status), so that only an abort or a crash fails the caller.
 *
 *   solve_bounded PROFILE.json
 */
#include "mucudnn.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PROFILE.json\n", argv[0]);
        return 2;
    }
    FILE *file = fopen(argv[1], "rb");
    if (!file) {
        perror(argv[1]);
        return 2;
    }
    static char profile[1 << 16];
    size_t length = fread(profile, 1, sizeof profile - 1, file);
    fclose(file);
    profile[length] = '\0';
    char *plans = NULL;
    mucudnnStatus_t status = mucudnnSolveProfile(profile, NULL, &plans);
    printf("status: %s\n", mucudnnGetStatusString(status));
    printf("last error: %s\n", mucudnnGetLastError());
    mucudnnFreeString(plans);
    return 0;
}
