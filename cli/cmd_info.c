#include "cli.h"
CLI_CMD(info) { (void)argc; (void)argv; return cli_fail("info: not built yet"); }
